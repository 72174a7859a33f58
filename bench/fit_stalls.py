"""Where a Spark fit's slow steps go: the CPU of every thread while a rank stalls (issue 45).

    .venv/bin/python bench/fit_stalls.py                 # runs itself under `perf sched record`
    .venv/bin/python bench/fit_stalls.py --rows 500000   # a smaller preset

Three ``TorchEstimator.fit`` calls of the large preset, bench/fit.py's own (``fit_ours``: 1M x 32
as an ML vector, MLP 32-128-64-1, Adam, batch 256, 1 epoch, ``local[2]``, 2 ranks); the third
is measured. Each rank stamps the
end of every optimizer step (``time.monotonic``, the clock ``perf`` is told to use). The whole
run is recorded with ``perf sched record -k CLOCK_MONOTONIC`` (Linux ``perf`` with the sched
tracepoints; root or ``perf_event_paranoid`` <= 1), then ``perf sched timehist`` gives every
stretch each thread ran on a CPU. Printed: the CPU seconds of every thread in the measured
fit's training window (the ranks' main threads, their reader threads, the JVM's, idle), the
number of steps longer than ``--stall-ms`` per rank with their total, and which threads ran
while those steps lasted. A thread other than the rank's own that runs during its stalls is
what the stall cost; ``<idle>`` means a CPU had nothing to run (a wake-up, or I/O).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

FITS = 3  # the last one is measured
LINE = re.compile(r"^\s*([\d.]+)\s+\[(\d+)\]\s+(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


class Stamps:
    """Rank callback: the end of every step (``time.monotonic``) into ``<prefix>.<rank>.json``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.stamps: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        self.stamps = []

    def on_train_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        self.stamps.append(time.monotonic())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        import threading

        import spark_estimators.collective.torch as hvd

        with open(f"{self.prefix}.{hvd.rank()}.json", "w") as f:
            json.dump({"tid": threading.get_native_id(), "stamps": self.stamps}, f)


def fits(rows: int, prefix: str) -> None:
    """The fits (run under perf): FITS fits, stamps of fit i in ``<prefix><i>.<rank>.json``."""
    from fit import PRESETS, build_data, fit_ours
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    cfg = {**PRESETS["large"], "rows": rows}
    _, vdf = build_data(spark, rows, cfg["features"])
    for i in range(FITS):  # bench/fit.py's fit of the preset, with the stamps
        out = fit_ours(vdf, cfg, callbacks=(Stamps(f"{prefix}{i}"),))
        print(f"fit {i + 1}: {out['total_s']:.2f} s", flush=True)


def stretches(timehist: str) -> list[tuple[float, float, str]]:
    """(start, end, thread) of every stretch a thread ran, from ``perf sched timehist``."""
    out = []
    for line in timehist.splitlines():
        m = LINE.match(line)
        if m:
            end, run = float(m.group(1)), float(m.group(6)) / 1e3
            out.append((end - run, end, m.group(3).strip()))
    return out


def report(
    ran: list[tuple[float, float, str]], ranks: dict[int, dict[str, Any]], stall: float
) -> None:
    """Print the window's CPU by thread, then each rank's stalls and who ran during them."""
    lo = min(r["stamps"][0] for r in ranks.values())
    hi = max(r["stamps"][-1] for r in ranks.values())
    window = [(max(s, lo), min(e, hi), t) for s, e, t in ran if e > lo and s < hi]
    busy: collections.Counter[str] = collections.Counter()
    for s, e, t in window:
        busy[t] += e - s
    print(f"measured fit: training window {hi - lo:.3f} s; CPU seconds by thread:")
    for thread, cpu in busy.most_common(16):
        print(f"  {thread:<44} {cpu:.3f}")
    for rank, data in sorted(ranks.items()):
        st = data["stamps"]
        slow = [(a, b) for a, b in zip(st[20:], st[21:], strict=False) if b - a > stall]
        total = sum(b - a for a, b in slow)
        print(f"rank {rank} (main thread {data['tid']}): {len(slow)} steps > "
              f"{stall * 1e3:g} ms, {total:.3f} s in all; CPU seconds during them:")  # fmt: skip
        during: collections.Counter[str] = collections.Counter()
        for a, b in slow:
            for s, e, t in window:
                if e > a and s < b:
                    during[t] += min(e, b) - max(s, a)
        for thread, cpu in during.most_common(10):
            print(f"  {thread:<44} {cpu:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--stall-ms", type=float, default=5.0)
    parser.add_argument("--fits-only", metavar="PREFIX", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fits_only:
        fits(args.rows, args.fits_only)
        return
    perf = shutil.which("perf")
    if perf is None:
        sys.exit("needs Linux perf (perf sched record)")
    work = tempfile.mkdtemp(prefix="bench-stalls-")
    data, prefix = os.path.join(work, "sched.data"), os.path.join(work, "steps")
    env = {**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)}
    subprocess.run(
        [perf, "sched", "record", "-k", "CLOCK_MONOTONIC", "-o", data, "--",
         sys.executable, os.path.abspath(__file__), "--rows", str(args.rows),
         "--fits-only", prefix],
        check=True, env=env,
    )  # fmt: skip
    timehist = subprocess.run(
        [perf, "sched", "timehist", "-i", data], check=True, capture_output=True, text=True
    ).stdout
    last = FITS - 1
    ranks = {}
    for rank in (0, 1):
        with open(f"{prefix}{last}.{rank}.json") as f:
            ranks[rank] = json.load(f)
    report(stretches(timehist), ranks, args.stall_ms / 1e3)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
