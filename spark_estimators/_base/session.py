"""Getting a SparkSession, and facts about the cluster behind it (task slots)."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from spark_estimators._base.versions import require_pyspark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

EMBEDDED_MASTER = "local[2]"


def ensure_driver_side(what: str) -> None:
    """Raise when a driver-only helper is called inside a Spark task."""
    from pyspark import TaskContext

    if TaskContext.get() is not None:
        raise RuntimeError(f"{what} can only be called on the Spark driver, not inside a task")


def get_spark(spark: SparkSession | None = None) -> SparkSession:
    """The given session, else the active one, else an embedded ``local[2]`` session.

    Only a session created here gets ``PYSPARK_PYTHON`` (this interpreter, so executors import
    the same packages) and ``SPARK_LOCAL_IP=127.0.0.1``; an existing session is never changed.
    """
    require_pyspark()
    if spark is not None:
        is_connect(spark)  # refuses a Connect session on a pyspark too old for it
        return spark
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    return create_local_session()


def create_local_session(master: str = EMBEDDED_MASTER, **conf: str) -> SparkSession:
    """Create the embedded session used by the demo, the tests and users without a cluster.

    Quiet in a notebook (issue 27): the JVM's start-up banner is dropped from stderr
    (:func:`~spark_estimators._base.output.quiet_jvm_start`), Spark's console stage bar is off
    (``spark__ui__showConsoleProgress="true"`` turns it on), and a TensorFlow imported later in
    this driver prints no start-up lines
    (:func:`~spark_estimators._base.output.quiet_driver_tensorflow`).
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from spark_estimators._base.output import quiet_driver_tensorflow, quiet_jvm_start

    if SparkContext._active_spark_context is not None and not conf:
        # A session runs already (another thread's): reuse it as it is. Our defaults would be
        # static settings it may not share, and Spark warns about each ("Using an existing
        # Spark session; only runtime SQL configurations will take effect").
        return SparkSession.builder.getOrCreate()

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
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in conf.items():
        builder = builder.config(key.replace("__", "."), value)
    if SparkContext._gateway is not None:  # the JVM runs already: nothing to quieten
        return builder.getOrCreate()
    with quiet_jvm_start():
        session = builder.getOrCreate()
    quiet_driver_tensorflow()
    return session


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


def _live_task_slots(spark: SparkSession) -> int | None:
    """Slots of the executors registered right now, as Spark's barrier check counts them."""
    try:
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception as exc:  # Spark Connect or a JVM without this method
        logger.debug("cannot read task slots from the scheduler: %s", exc)
        return None


def is_connect(spark: SparkSession) -> bool:
    """True for a Spark Connect client session (no SparkContext, no JVM in this process).

    Raises :class:`~spark_estimators.errors.ConfigurationError` for a Connect session when the
    pyspark client is older than 4.0 (see :mod:`spark_estimators._base.versions`).
    """
    connect = type(spark).__module__.startswith("pyspark.sql.connect")
    if connect:
        require_pyspark(connect=True)
    return connect


def spark_conf(spark: SparkSession, key: str, default: str | None = None) -> str | None:
    """One Spark setting, read the same way from a classic or a Connect session."""
    if not is_connect(spark):
        # SparkContext._conf reads the JVM's conf in one py4j call; getConf() copies every
        # setting first (22-26 ms a read here, ~50 ms of each run(): bench/RESULTS.md, issue 45).
        value = spark.sparkContext._conf.get(key, default)  # noqa: SLF001
        return None if value is None else str(value)
    try:
        value = spark.conf.get(key, default)
    except Exception as exc:  # a key the server refuses to show
        logger.debug("cannot read %s from the Connect server: %s", key, exc)
        return default
    return None if value is None else str(value)


def spark_master(spark: SparkSession) -> str:
    """The master URL (``local[2]``, ``spark://...``, ``yarn``, ...)."""
    if not is_connect(spark):
        return str(spark.sparkContext.master)
    return spark_conf(spark, "spark.master", "") or ""


def available_task_slots(spark: SparkSession, needed: int = 0, wait_s: float = 0.0) -> int | None:
    """Total concurrent task slots of the cluster, or None when it cannot be known up front.

    ``local[N]`` is read from the master string. Other clusters ask the scheduler (the figure
    Spark's own barrier check uses), waiting up to ``wait_s`` for executors that are still
    starting until ``needed`` slots exist, so Spark's barrier check (which retries only every
    15 s) does not see too few. With dynamic allocation the figure grows on demand, so no
    limit is returned. A Spark Connect client cannot ask the scheduler: beyond ``local[N]`` it
    returns None and Spark's own barrier check decides.
    """
    task_cpus = int(spark_conf(spark, "spark.task.cpus", "1") or 1)
    master = spark_master(spark)
    configured = _local_cores(master)
    configured_slots = None if configured is None else max(configured // task_cpus, 0)
    if configured_slots is not None and (
        not master.startswith("local-cluster") or configured_slots < needed
    ):
        return configured_slots
    if (spark_conf(spark, "spark.dynamicAllocation.enabled", "false") or "").lower() == "true":
        return None
    if is_connect(spark):
        return configured_slots
    sc = spark.sparkContext
    deadline = time.monotonic() + wait_s
    while True:
        live = _live_task_slots(spark)
        if live is None:
            return configured_slots if configured_slots is not None else sc.defaultParallelism
        if live >= needed or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)  # executors are still registering with the scheduler


def default_num_proc(spark: SparkSession) -> int:
    """``spark.default.parallelism``, like horovod.spark.run (the master's cores on Connect)."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    configured = spark_conf(spark, "spark.default.parallelism")
    if configured:
        return int(configured)
    cores = _local_cores(spark_master(spark))
    if cores is not None:
        return cores
    from spark_estimators.errors import ConfigurationError

    raise ConfigurationError(
        "num_proc is not given and the Spark Connect server does not show "
        "spark.default.parallelism: pass num_proc= (the number of ranks) explicitly"
    )


def start_job_group(spark: SparkSession, job_id: str, description: str) -> None:
    """Mark the Spark jobs this thread starts next as ``job_id`` (for :func:`cancel_job_group`).

    Classic sessions use a job group (interrupting the tasks on cancel); a Spark Connect client
    has no SparkContext, so it tags its operations (``addTag``) instead.
    """
    if is_connect(spark):
        spark.addTag(job_id)
    else:
        spark.sparkContext.setJobGroup(job_id, description, interruptOnCancel=True)


def end_job_group(spark: SparkSession, job_id: str) -> None:
    """Stop marking this thread's jobs as ``job_id``."""
    if is_connect(spark):
        spark.removeTag(job_id)


def cancel_job_group(spark: SparkSession, job_id: str) -> None:
    """Cancel the running jobs marked ``job_id`` (from any thread)."""
    if is_connect(spark):
        spark.interruptTag(job_id)
    else:
        spark.sparkContext.cancelJobGroup(job_id)


def running_tasks(spark: SparkSession, job_id: str) -> dict[int, str]:
    """Partition index -> executor host of the running tasks of job group ``job_id``.

    Read from the driver's status store (classic sessions only; ``{}`` for Spark Connect or
    when Spark cannot tell). Used to name the hosts whose tasks run but never reached the
    driver service.
    """
    if is_connect(spark):
        return {}
    try:
        sc = spark.sparkContext
        tracker = sc.statusTracker()
        store = sc._jsc.sc().statusStore()
        out: dict[int, str] = {}
        for job in tracker.getJobIdsForGroup(job_id):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else ():
                stage_info = tracker.getStageInfo(stage)
                if stage_info is None:
                    continue
                tasks = store.taskList(stage, stage_info.currentAttemptId, 10_000).iterator()
                while tasks.hasNext():
                    task = tasks.next()
                    if task.status() == "RUNNING":
                        out[int(task.index())] = str(task.host())
        return out
    except Exception as exc:  # Py4J / status store differences across Spark versions
        logger.debug("cannot list the running tasks of %s: %s", job_id, exc)
        return {}


def driver_service_host(spark: SparkSession, override: str | None = None) -> str:
    """The address executors use to reach this process's driver service.

    In order: ``override`` (the ``driver_host=`` argument), the environment variable
    ``SPARK_ESTIMATORS_DRIVER_HOST``, then for a classic session ``spark.driver.host`` (this
    process is the Spark driver). A Spark Connect client is not the Spark driver: for a server
    on this machine (``sc://localhost``) it is 127.0.0.1, else the address of this machine's
    interface that routes to the Connect server.
    """
    from spark_estimators import envvars as ev

    if override:
        return override
    env = os.environ.get(ev.DRIVER_HOST)
    if env:
        return env
    if not is_connect(spark):
        return str(spark_conf(spark, "spark.driver.host", "127.0.0.1"))
    server = _connect_server_host(spark)
    if server is None or server in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((server, 15002))  # UDP connect sends nothing: it only picks a route
            return str(probe.getsockname()[0])
    except OSError as exc:
        logger.warning(
            "cannot find this machine's address towards the Connect server %s (%s); set "
            "SPARK_ESTIMATORS_DRIVER_HOST to an address the executors can reach",
            server,
            exc,
        )
        return socket.gethostbyname(socket.gethostname())


def _connect_server_host(spark: Any) -> str | None:  # a Connect session: its own class
    try:
        return str(spark.client.host)
    except Exception:
        try:
            return str(spark._client._builder.host)
        except Exception:
            return None
