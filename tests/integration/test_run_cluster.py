"""Rank layout on a real 2-executor local-cluster (each executor a logical host)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "cluster_ranks.py"


def test_local_and_cross_ranks_on_two_executors():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "2", "2"], capture_output=True, text=True, timeout=280
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert [int(r["RANK"]) for r in out] == [0, 1, 2, 3]
    hosts = [r["SPARK_ESTIMATORS_HOSTNAME"] for r in out]
    # Ranks of one host are contiguous: two hosts, two ranks each.
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert [int(r["LOCAL_RANK"]) for r in out] == [0, 1, 0, 1]
    assert {r["LOCAL_WORLD_SIZE"] for r in out} == {"2"}
    assert [int(r["SPARK_ESTIMATORS_CROSS_RANK"]) for r in out] == [0, 0, 1, 1]
    assert [int(r["GROUP_RANK"]) for r in out] == [0, 0, 1, 1]
    assert {r["SPARK_ESTIMATORS_CROSS_SIZE"] for r in out} == {"2"}
