"""``make demo``: a first job on an embedded local[2] SparkSession.

Run with ``python -m spark_estimators.demo``. Until an estimator is available this runs
:func:`spark_estimators.run` with a gradient-style allreduce across 2 ranks.
"""

from __future__ import annotations

import time


def _allreduce_job(n: int) -> dict[str, float]:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, size = dist.get_rank(), dist.get_world_size()
    local = torch.arange(n, dtype=torch.float64) * (rank + 1)
    total = local.clone()
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"rank {rank}/{size} pid {os.getpid()}: local sum {local.sum().item():.0f}")
    return {"rank": rank, "allreduced_sum": float(total.sum().item())}


def main() -> None:
    import spark_estimators
    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    n = 1000
    t0 = time.perf_counter()
    results = spark_estimators.run(_allreduce_job, args=(n,), num_proc=2, spark=spark)
    elapsed = time.perf_counter() - t0
    expected = sum(range(n)) * (1 + 2)
    print()
    print(
        f"spark_estimators.run on {spark.sparkContext.master}: {len(results)} ranks, {elapsed:.2f}s"
    )
    for r in results:
        ok = "ok" if r["allreduced_sum"] == expected else "WRONG"
        print(
            f"  rank {r['rank']}: allreduced sum = {r['allreduced_sum']:.0f} "
            f"(expected {expected}) {ok}"
        )
    spark.stop()


if __name__ == "__main__":
    main()
