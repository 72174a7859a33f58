"""Inference throughput: TorchModel.transform (Arrow batches) vs a per-row UDF, same run.

Usage: .venv/bin/python bench/transform.py [--rows 200000]

The per-row UDF is how horovod.spark's TorchModel predicted (one Python call and one forward
pass per row). Both score the same cached DataFrame of 32-float vectors with the same MLP on
local[2]; each is run once to warm the Python workers, then timed, writing to the ``noop`` sink.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()

    import torch
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    from spark_estimators.core.session import create_local_session
    from spark_estimators.torch import TorchModel

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    d = 32
    df = (
        spark.range(args.rows, numPartitions=2)
        .select(array_to_vector(F.array(*[F.rand(seed=i) for i in range(d)])).alias("features"))
        .cache()
    )
    df.count()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).eval()
    model = TorchModel(model=net, output_shapes=[()], featureCols=["features"], labelCols=["y"])

    def per_row(v: Any) -> float:
        with torch.no_grad():
            return float(net(torch.tensor(v.toArray(), dtype=torch.float32).unsqueeze(0)))

    row_udf = F.udf(per_row, DoubleType())

    def ours() -> None:
        model.transform(df).write.mode("overwrite").format("noop").save()

    def baseline() -> None:
        df.select(row_udf("features").alias("p")).write.mode("overwrite").format("noop").save()

    timings = {}
    for name, fn in (("TorchModel.transform", ours), ("per-row UDF", baseline)):
        fn()  # warm-up: Python workers, model load
        t0 = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - t0
    print(f"{args.rows} rows x {d} floats, MLP {d}-64-1, local[2]")
    for name, s in timings.items():
        print(f"{name:22s} {s:7.2f} s  {args.rows / s:12,.0f} rows/s")
    ratio = timings["per-row UDF"] / timings["TorchModel.transform"]
    print(f"speed-up vs per-row = {ratio:.1f}x")
    spark.stop()


if __name__ == "__main__":
    main()
