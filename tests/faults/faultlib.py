"""Helpers of the fault-injection suite: failure clocks and subprocess Spark sessions.

Every case measures its bound from the moment the fault is injected: the faulty rank writes
``time.time()`` into a *clock file* just before it fails, and the test compares that with the
moment the driver call returned or raised.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def fault_time(clock: pathlib.Path) -> float:
    """When the fault was injected (written by the faulty rank); fails the test if never."""
    assert clock.exists(), f"the fault was never injected (no clock file {clock})"
    return float(clock.read_text().strip())


def seconds_since_fault(clock: pathlib.Path) -> float:
    return time.time() - fault_time(clock)


def run_script(name: str, *args: str, timeout: float) -> tuple[dict, float]:
    """Run ``tests/faults/scripts/<name>`` in its own process (its own SparkSession).

    Returns the JSON the script prints on its ``RESULT`` line and the wall time.
    """
    started = time.monotonic()
    env = dict(os.environ)
    env.pop("SPARK_ESTIMATORS_TEST_SESSION", None)  # its rank processes are its own business
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    elapsed = time.monotonic() - started
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :]), elapsed
