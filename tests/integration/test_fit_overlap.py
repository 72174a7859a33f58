"""Rank start-up off the critical path: spare rank processes, and a failed write's clean end.

See spark_estimators/task/spare.py: an estimator's Spark task adopts a spare process that has
imported torch ahead (started when the task began, or when the worker's previous rank ended).
A spare has never run user code and serves one rank only, so nothing of one fit reaches the
next; these tests check that on real processes, and that a write that fails ends the fit
before any rank starts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from spark_estimators import run  # noqa: E402
from spark_estimators.task import spare  # noqa: E402
from tests.conftest import rank_processes  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def dirty() -> dict:
    """A rank that changes everything a reused process could carry into the next rank."""
    import builtins
    import os
    import sys

    import torch
    import torch.distributed as dist

    default_threads = torch.get_num_threads()
    os.environ["SE_LEAK"] = "1"
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    sys.modules["se_leak_module"] = type(sys)("se_leak_module")
    builtins.se_leak = True  # type: ignore[attr-defined]
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    return {"pid": os.getpid(), "threads": default_threads}


def probe() -> dict:
    """What a rank finds at its start: was torch already imported, and any trace of `dirty`?"""
    import builtins
    import os
    import sys
    import tempfile

    had_torch = "torch" in sys.modules
    import torch

    return {
        "pid": os.getpid(),
        "had_torch": had_torch,
        "env_leak": "SE_LEAK" in os.environ,
        "module_leak": "se_leak_module" in sys.modules,
        "builtin_leak": hasattr(builtins, "se_leak"),
        "seed": torch.initial_seed(),
        "threads": torch.get_num_threads(),
        "dist": torch.distributed.is_available() and torch.distributed.is_initialized(),
        "rank": os.environ["RANK"],
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "tmp": tempfile.gettempdir(),
        "tmpdir_env": os.environ.get("TMPDIR"),
    }


def test_a_spare_rank_process_is_adopted_and_carries_nothing_of_the_previous_rank(spark):
    first = run(spare.with_preimports(dirty, "torch"), num_proc=2, spark=spark, verbose=0)
    later = run(spare.with_preimports(probe, "torch"), num_proc=2, spark=spark, verbose=0)
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in later)
    for rank, (was, now) in enumerate(zip(first, later, strict=True)):
        assert now["had_torch"] is True  # a spare, torch imported before the rank began
        assert now["rank"] == str(rank)
        assert (now["env_leak"], now["module_leak"], now["builtin_leak"]) == (False,) * 3
        assert now["seed"] != 1234
        assert now["threads"] == was["threads"]
        assert now["dist"] is False
        if now["tmpdir_env"]:  # the rank's TMPDIR, not the one the spare started with
            assert now["tmp"] == now["tmpdir_env"]


def test_an_import_time_variable_gets_a_process_started_with_it(spark):
    results = run(
        spare.with_preimports(probe, "torch"),
        num_proc=2,
        spark=spark,
        verbose=0,
        env={"OMP_NUM_THREADS": "3"},  # PySpark's workers have 1 (spark.task.cpus)
    )
    assert [r["had_torch"] for r in results] == [False, False]
    assert [r["omp"] for r in results] == ["3", "3"]


def test_plain_run_starts_plain_processes(spark):
    assert spare.preimports(probe) == ()
    results = run(probe, num_proc=2, spark=spark, verbose=0)
    assert [r["had_torch"] for r in results] == [False, False]


def test_a_failed_write_fails_the_fit_before_any_rank_starts(spark, tmp_path):
    import torch

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    @F.udf(T.DoubleType())
    def broken(v):
        raise ValueError("boom-in-the-write")

    df = spark.range(64, numPartitions=2).select(
        F.col("id").cast("double").alias("x"), broken(F.col("id").cast("double")).alias("y")
    )
    model = torch.nn.Linear(1, 1)
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=8,
        epochs=1,
        verbose=0,
    )
    before = set(spark.sparkContext.statusTracker().getActiveJobsIds())
    with pytest.raises(Exception, match="boom-in-the-write"):
        est.fit(df)
    assert rank_processes() == []
    tracker = spark.sparkContext.statusTracker()
    assert set(tracker.getActiveJobsIds()) - before == set()


def _spares_importing(module: str) -> list[int]:
    """Live spare processes of this test session that import ``module``."""
    import os

    import psutil

    from tests.conftest import SESSION_MARKER

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info.get("cmdline") or []
        if "spark_estimators.task.spare_process" not in cmd or module not in cmd[-1:]:
            continue
        try:
            if proc.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER]:
                found.append(proc.info["pid"])
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return found


def test_the_write_tasks_start_the_spares_so_imports_overlap_the_write(spark, tmp_path):
    from spark_estimators.data import prepare_data
    from spark_estimators.store import LocalStore

    df = spark.range(64, numPartitions=2).select(
        F.col("id").cast("double").alias("x"), (F.col("id") * 2.0).alias("y")
    )
    assert _spares_importing("colorsys") == []
    meta = prepare_data(
        2, LocalStore(str(tmp_path)), df, ["x"], ["y"], verbose=0, rank_imports=("colorsys",)
    )
    assert meta.train_rows == 64
    assert len(_spares_importing("colorsys")) >= 1  # one per PySpark worker that wrote
    assert rank_processes() == []
