"""Run in its own process: the public API from a Spark Connect client.

Starts a real local Spark Connect server (``SparkSession.builder.remote("local[2]")``, from the
jars in the pyspark wheel) and drives run, run_elastic, the README quickstart (TorchEstimator fit +
transform), fit_on_parquet, Pipeline save/load and bad input through it. Prints ``RESULT <json>``;
the test compares it with the same steps on a classic session.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import connect_steps as steps  # noqa: E402


def main() -> None:
    spark = (
        SparkSession.builder.remote("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .getOrCreate()
    )
    out: dict = {"session": type(spark).__module__}
    try:
        with tempfile.TemporaryDirectory(prefix="se-connect-") as tmp:
            out.update(steps.all_steps(spark, tmp))
    finally:
        spark.stop()
    print("RESULT " + json.dumps(out, default=lambda o: np.asarray(o).tolist()))


if __name__ == "__main__":
    main()
