"""Collective start-up of a 2-rank ``run()``: what the rendezvous store costs (issue 27 item 9).

Usage: .venv/bin/python bench/rendezvous.py [--repeats 7]

Each repeat runs ``spark_estimators.run`` with 2 ranks on local[2] whose function times
``collective.init(backend="gloo")`` (the rendezvous: the store, the Gloo group), one 4-float
allreduce, an 8 MiB allreduce and ``shutdown()``; the first run warms the Python workers and is
not counted. Prints the medians of the run() wall time, rank 0's init time and the 8 MiB
allreduce time. To compare two versions, run it with each (e.g. ``PYTHONPATH=<other checkout>``)
one after the other on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from spark_estimators.core.session import create_local_session


def ranked() -> dict[str, float]:
    """Runs on each rank: time the collective's start and two allreduces."""
    import time

    import numpy as np

    from spark_estimators import collective

    t0 = time.perf_counter()
    collective.init(backend="gloo")
    t1 = time.perf_counter()
    collective.allreduce(np.ones(4, dtype=np.float32))
    big = np.ones(2 << 20, dtype=np.float32)
    t2 = time.perf_counter()
    collective.allreduce(big)
    t3 = time.perf_counter()
    collective.shutdown()
    return {"init": t1 - t0, "allreduce_8mib": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    spark = create_local_session("local[2]")
    import spark_estimators

    spark_estimators.run(ranked, num_proc=2, spark=spark)  # warm-up
    walls, inits, reduces = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = spark_estimators.run(ranked, num_proc=2, spark=spark)
        walls.append(time.perf_counter() - t0)
        inits.append(out[0]["init"])
        reduces.append(max(r["allreduce_8mib"] for r in out))
    med = statistics.median
    print(f"run() wall s: median {med(walls):.3f} (min {min(walls):.3f}, max {max(walls):.3f})")
    print(f"rank 0 collective.init s: median {med(inits):.3f} (min {min(inits):.3f})")
    print(f"8 MiB allreduce s: median {med(reduces):.4f} (min {min(reduces):.4f})")
    spark.stop()


if __name__ == "__main__":
    main()
