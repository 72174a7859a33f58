"""Launch overhead: spark_estimators.run vs TorchDistributor vs a bare barrier job.

Usage: .venv/bin/python bench/launch.py [--repeats 5]

All three run a trivial function with 2 processes on the same local[2] session, in one process,
after one warm-up each (warm JVM and Python workers). Prints medians and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from spark_estimators.core.session import create_local_session


def trivial() -> int:
    return 1


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spark = create_local_session("local[2]")

    import spark_estimators

    def ours() -> object:
        return spark_estimators.run(trivial, num_proc=2, spark=spark)

    def bare() -> object:
        def noop(batches):
            yield from batches

        return spark.range(2, numPartitions=2).mapInArrow(noop, "id long", barrier=True).collect()

    def torch_distributor() -> object:
        from pyspark.ml.torch.distributor import TorchDistributor

        return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(trivial)

    rows = {}
    rows["bare barrier mapInArrow"] = timed(bare, args.repeats)
    rows["spark_estimators.run"] = timed(ours, args.repeats)
    rows["TorchDistributor"] = timed(torch_distributor, max(2, args.repeats // 2))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'case':28s} {'median s':>9s} {'min s':>7s} {'max s':>7s}")
    for k, v in rows.items():
        print(f"{k:28s} {med[k]:9.3f} {min(v):7.3f} {max(v):7.3f}")
    print(f"ours / TorchDistributor = {med['spark_estimators.run'] / med['TorchDistributor']:.3f}")
    print(
        "ours - bare barrier job = "
        f"{med['spark_estimators.run'] - med['bare barrier mapInArrow']:.3f} s"
    )
    spark.stop()


if __name__ == "__main__":
    main()
