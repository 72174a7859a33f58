"""Run in its own process: run(fn) on a local-cluster whose executor has 2 fake GPUs.

Spark's resource scheduler assigns the GPUs (from a discovery script, no CUDA needed); each rank
reports what it sees. Prints ``RESULT <json>``.
"""

import json
import os
import stat
import sys
import tempfile

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark.sql import SparkSession  # noqa: E402

import spark_estimators  # noqa: E402


def seen():
    import os

    from spark_estimators.task import get_available_devices, get_device

    return {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "available": get_available_devices(),
        "device": get_device(),
    }


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="se-fakegpu-")
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    os.chmod(script, stat.S_IRWXU)
    spark = (
        SparkSession.builder.master("local-cluster[1,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.worker.resource.gpu.amount", "2")
        .config("spark.worker.resource.gpu.discoveryScript", script)
        .config("spark.executor.resource.gpu.amount", "2")
        .config("spark.executor.resource.gpu.discoveryScript", script)
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    try:
        out = spark_estimators.run(seen, num_proc=2, spark=spark, start_timeout=120, backend="gloo")
        print("RESULT " + json.dumps(out))
    finally:
        spark.stop()
        os.remove(script)
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
