"""Run in its own process: run(fn) on a 2-executor local-cluster, print the rank layout as JSON."""

import json
import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark.sql import SparkSession  # noqa: E402

import spark_estimators  # noqa: E402


def layout():
    import os

    keys = [
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "SPARK_ESTIMATORS_CROSS_RANK",
        "SPARK_ESTIMATORS_CROSS_SIZE",
        "SPARK_ESTIMATORS_HOSTNAME",
    ]
    return {k: os.environ[k] for k in keys}


def main() -> None:
    executors, cores = int(sys.argv[1]), int(sys.argv[2])
    spark = (
        SparkSession.builder.master(f"local-cluster[{executors},{cores},1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.executorEnv.SPARK_ESTIMATORS_HOST_HASH_SALT", "{executor}")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .getOrCreate()
    )
    try:
        out = spark_estimators.run(
            layout, num_proc=executors * cores, spark=spark, start_timeout=120
        )
        print("RESULT " + json.dumps(out))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
