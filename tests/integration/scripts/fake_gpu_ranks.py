"""Run in its own process: run(fn) on a local-cluster of executors with 2 fake GPUs each.

Spark's resource scheduler assigns the GPUs (from a discovery script, no CUDA needed); each rank
reports what it sees. ``argv[1]``: the number of executors (each a host of its own through the
host-hash salt), ``argv[2]``: the addresses the discovery script reports (default ``0,1``),
``argv[3]``: GPUs per task (default 1). Prints ``RESULT <json>``.
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
        "host": os.environ["SPARK_ESTIMATORS_HOSTNAME"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "available": get_available_devices(),
        "device": get_device(),
    }


def main() -> None:
    executors = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    addresses = (sys.argv[2] if len(sys.argv) > 2 else "0,1").split(",")
    per_task = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    tmp = tempfile.mkdtemp(prefix="se-fakegpu-")
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\necho '{json.dumps({'name': 'gpu', 'addresses': addresses})}'\n")
    os.chmod(script, stat.S_IRWXU)
    n = len(addresses)
    spark = (
        SparkSession.builder.master(f"local-cluster[{executors},{n // per_task},1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.executorEnv.SPARK_ESTIMATORS_HOST_HASH_SALT", "{executor}")
        .config("spark.worker.resource.gpu.amount", str(n))
        .config("spark.worker.resource.gpu.discoveryScript", script)
        .config("spark.executor.resource.gpu.amount", str(n))
        .config("spark.executor.resource.gpu.discoveryScript", script)
        .config("spark.task.resource.gpu.amount", str(per_task))
        .config("spark.task.cpus", "1")
        .getOrCreate()
    )
    try:
        num_proc = executors * n // per_task
        out = spark_estimators.run(
            seen, num_proc=num_proc, spark=spark, start_timeout=120, backend="gloo"
        )
        print("RESULT " + json.dumps(out))
    finally:
        spark.stop()
        os.remove(script)
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
