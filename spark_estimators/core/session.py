"""Getting a SparkSession, and facts about the cluster behind it (task slots)."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_MASTER = "local[2]"


def ensure_driver_side(what: str) -> None:
    """Raise when a driver-only helper is called inside a Spark task."""
    from pyspark import TaskContext

    if TaskContext.get() is not None:
        raise RuntimeError(f"{what} can only be called on the Spark driver, not inside a task")


def get_spark(spark: Any = None) -> Any:
    """The given session, else the active one, else an embedded ``local[2]`` session.

    Only a session created here gets ``PYSPARK_PYTHON`` (this interpreter, so executors import
    the same packages) and ``SPARK_LOCAL_IP=127.0.0.1``; an existing session is never changed.
    """
    if spark is not None:
        return spark
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    return create_local_session()


def create_local_session(master: str = EMBEDDED_MASTER, **conf: str) -> Any:
    """Create the embedded session used by the demo, the tests and users without a cluster."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(master)
        .appName("spark_estimators")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    for key, value in conf.items():
        builder = builder.config(key.replace("__", "."), value)
    return builder.getOrCreate()


def _local_cores(master: str) -> int | None:
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\*|\d+)(?:,\s*\d+)?\]", master)
    if m:
        return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        return int(m.group(1)) * int(m.group(2))
    return None


def _live_task_slots(spark: Any) -> int | None:
    """Slots of the executors registered right now, as Spark's barrier check counts them."""
    try:
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception as exc:  # Spark Connect or a JVM without this method
        logger.debug("cannot read task slots from the scheduler: %s", exc)
        return None


def available_task_slots(spark: Any, needed: int = 0, wait_s: float = 0.0) -> int | None:
    """Total concurrent task slots of the cluster, or None when it cannot be known up front.

    ``local[N]`` is read from the master string. Other clusters ask the scheduler (the figure
    Spark's own barrier check uses), waiting up to ``wait_s`` for executors that are still
    starting until ``needed`` slots exist, so Spark's barrier check (which retries only every
    15 s) does not see too few. With dynamic allocation the figure grows on demand, so no
    limit is returned.
    """
    sc = spark.sparkContext
    conf = sc.getConf()
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    master = sc.master
    configured = _local_cores(master)
    configured_slots = None if configured is None else max(configured // task_cpus, 0)
    if configured_slots is not None and (
        not master.startswith("local-cluster") or configured_slots < needed
    ):
        return configured_slots
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        return None
    deadline = time.monotonic() + wait_s
    while True:
        live = _live_task_slots(spark)
        if live is None:
            return configured_slots if configured_slots is not None else sc.defaultParallelism
        if live >= needed or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)  # executors are still registering with the scheduler


def default_num_proc(spark: Any) -> int:
    """``spark.default.parallelism``, like horovod.spark.run."""
    return int(spark.sparkContext.defaultParallelism)
