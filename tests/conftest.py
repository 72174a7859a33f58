"""Shared fixtures: one session-scoped local[2] SparkSession, free ports, leak checks."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Inherited by the JVM, its Python workers and the rank processes they start: lets the leak check
# tell this test session's rank processes from other sessions' on the same machine.
SESSION_MARKER = "SPARK_ESTIMATORS_TEST_SESSION"
os.environ.setdefault(SESSION_MARKER, str(os.getpid()))
# MLflow's telemetry thread (started when mlflow is imported) imports modules while MLflow's
# autologging import hooks hold their lock: a test turning mlflow.autolog() on deadlocked in it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    tmp = tempfile.mkdtemp(prefix="se-spark-")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark_estimators-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.task.maxFailures", "1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.local.dir", tmp)
        .config("spark.sql.warehouse.dir", os.path.join(tmp, "warehouse"))
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def free_port():
    def _free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return _free


def _forked_rank(proc, cmd: list[str]) -> bool:
    """A rank forked by a zygote (task/zygote.py): a spare_process child of a spare_process."""
    zygote = "spark_estimators.task.spare_process"
    if zygote not in cmd:
        return False
    parent = proc.parent()
    return parent is not None and zygote in parent.cmdline()


def rank_processes() -> list[int]:
    """PIDs of rank processes started by the launcher that are still alive."""
    import psutil

    found = []
    marker = os.environ[SESSION_MARKER]
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info.get("cmdline") or []
        if proc.info.get("status") == "zombie":
            continue
        try:
            if "spark_estimators.task.child" not in cmd and not _forked_rank(proc, cmd):
                continue
            if proc.environ().get(SESSION_MARKER) == marker:
                found.append(proc.info["pid"])
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return found


@pytest.fixture(autouse=True)
def _no_leaked_rank_processes(request):
    """Fail a launcher test that leaves a rank process behind."""
    yield
    if "spark" not in request.fixturenames and "multiprocess" not in request.keywords:
        return
    import psutil

    leftover = rank_processes()
    if leftover:
        # Give killed processes a moment to be reaped by their parents before calling it a leak.
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in leftover], timeout=5)
        leftover = [p.pid for p in alive]
    assert not leftover, f"rank processes left running: {leftover}"
