"""Run in its own process: data="stream" fits from a Spark Connect client (see stream_steps).

Starts a real local Spark Connect server (``SparkSession.builder.remote("local[2]")``) and prints
``RESULT <json>``.
"""

import json
import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark.sql import SparkSession  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import stream_steps  # noqa: E402


def main() -> None:
    spark = (
        SparkSession.builder.remote("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .getOrCreate()
    )
    out: dict = {"session": type(spark).__module__}
    try:
        out.update(stream_steps.all_steps(spark))
    finally:
        spark.stop()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
