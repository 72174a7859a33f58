"""Rank start-up off the critical path: ranks forked from a zygote, and a failed write's end.

See spark_estimators/task/spare.py: each executor keeps a zygote that imported torch and
the rank's modules once (started by the first write or training task), and an estimator's Spark
task forks its rank from it. The zygote has never run user code and each fork serves one rank
only, so nothing of one fit reaches the next; these tests check that on real processes, and that
a write that fails ends the fit before any rank starts.
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


def test_a_forked_rank_process_carries_nothing_of_the_previous_rank(spark):
    first = run(spare.with_preimports(dirty, "torch"), num_proc=2, spark=spark, verbose=0)
    later = run(spare.with_preimports(probe, "torch"), num_proc=2, spark=spark, verbose=0)
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in later)
    for rank, (was, now) in enumerate(zip(first, later, strict=True)):
        assert now["had_torch"] is True  # forked by the zygote: torch imported before it began
        assert now["rank"] == str(rank)
        assert (now["env_leak"], now["module_leak"], now["builtin_leak"]) == (False,) * 3
        assert now["seed"] != 1234
        assert now["threads"] == was["threads"]
        assert now["dist"] is False
        if now["tmpdir_env"]:  # the rank's TMPDIR, not the zygote's
            assert now["tmp"] == now["tmpdir_env"]


def lineage() -> dict:
    """Where a rank process came from: its parent (a zygote?) and a draw of numpy's generator."""
    import os

    import numpy as np
    import psutil

    parent = psutil.Process().parent()
    return {
        "pid": os.getpid(),
        "zygote": parent.pid,
        "forked": "spark_estimators.task.spare_process" in parent.cmdline(),
        "own_group": os.getpgid(0) == os.getpid(),
        "draw": float(np.random.random()),
    }


def test_later_fits_fork_their_ranks_from_the_zygote_their_worker_keeps(spark):
    """Issue 26: one zygote per PySpark worker imports once; each rank is a fresh fork of it."""
    fn = spare.with_preimports(lineage, "torch")
    runs = [run(fn, num_proc=2, spark=spark, verbose=0) for _ in range(3)]
    ranks = [r for results in runs for r in results]
    assert all(r["forked"] and r["own_group"] for r in ranks)
    assert len({r["pid"] for r in ranks}) == 6  # a new process for every rank
    assert len({r["draw"] for r in ranks}) == 6  # each child's generator seeded afresh
    # The zygotes outlive the fits: the later fits' ranks come from ones an earlier fit used.
    seen: set[int] = set()
    for results in runs:
        zygotes = {r["zygote"] for r in results}
        if seen:
            assert zygotes & seen
        seen |= zygotes


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


def _zygotes_importing(module: str) -> list[int]:
    """Live zygotes of this test session that import ``module``."""
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


def test_the_write_tasks_start_the_zygote_so_imports_overlap_the_write(spark, tmp_path):
    from spark_estimators.data import prepare_data
    from spark_estimators.store import LocalStore

    df = spark.range(64, numPartitions=2).select(
        F.col("id").cast("double").alias("x"), (F.col("id") * 2.0).alias("y")
    )
    assert _zygotes_importing("colorsys") == []
    meta = prepare_data(
        2, LocalStore(str(tmp_path)), df, ["x"], ["y"], verbose=0, rank_imports=("colorsys",)
    )
    assert meta.train_rows == 64
    # Both write tasks asked; the executor has one zygote (local mode: one executor).
    assert len(_zygotes_importing("colorsys")) == 1
    assert rank_processes() == []


def _seeded_fit(
    spark, store, seed: int, env: dict | None, log_dir: str, data: str = "parquet"
) -> dict:
    """A seeded TorchEstimator fit (dropout: the ranks' RNG counts); its weights and its ranks.

    Each rank records at ``on_train_begin`` whether it was forked by the zygote (``sys.argv[0]``
    of a zygote and its forks is ``spare_process.py``) and what torch's generator and thread
    pool were then.
    """
    import json
    import os

    import torch

    from spark_estimators.core.backend import SparkBackend
    from spark_estimators.torch import TorchEstimator

    class RankProbe:
        def on_train_begin(self, logs):
            import json as _json
            import os as _os
            import sys as _sys

            import torch as _torch

            record = {
                "pid": _os.getpid(),
                "spare": _sys.argv[0].endswith("spare_process.py"),
                "rank": int(_os.environ["RANK"]),
                "rng": _torch.get_rng_state().sum().item(),
                "threads": _torch.get_num_threads(),
            }
            path = _os.path.join(log_dir, f"{seed}-{_os.getpid()}.json")
            with open(path, "w") as f:
                _json.dump(record, f)

    df = spark.range(96, numPartitions=2).select(
        (F.col("id") % 7).cast("double").alias("x"),
        ((F.col("id") % 7) * 0.5 + 1.0).alias("y"),
    )
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    est = TorchEstimator(
        backend=SparkBackend(num_proc=2, env=env, verbose=0),
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=8,
        epochs=2,
        random_seed=seed,
        callbacks=[RankProbe()],
        verbose=0,
        **({"data": data} if data != "parquet" else {}),
    )
    weights = est.fit(df).getModel().state_dict()
    ranks = []
    for name in sorted(os.listdir(log_dir)):
        if name.startswith(f"{seed}-"):
            with open(os.path.join(log_dir, name)) as f:
                ranks.append(json.load(f))
            os.remove(os.path.join(log_dir, name))
    return {"weights": weights, "ranks": sorted(ranks, key=lambda r: r["rank"])}


def test_a_later_fit_of_forked_ranks_learns_what_plain_rank_processes_learn(spark, tmp_path):
    """Issue 26: forked ranks must not change what a fit learns (seeded, dropout on every rank)."""
    import torch

    from spark_estimators.store import LocalStore

    store = LocalStore(str(tmp_path / "store"))
    log_dir = tmp_path / "ranks"
    log_dir.mkdir()
    first = _seeded_fit(spark, store, 3, None, str(log_dir))  # starts the zygote for the next fit
    served = _seeded_fit(spark, store, 11, None, str(log_dir))
    # A TORCH* variable the zygote was not started with: plain rank processes (task/spare.py).
    plain = _seeded_fit(spark, store, 11, {"TORCH_SE_PLAIN_RANKS": "1"}, str(log_dir))
    assert [r["spare"] for r in served["ranks"]] == [True, True]
    assert [r["spare"] for r in plain["ranks"]] == [False, False]
    assert [r["rank"] for r in served["ranks"]] == [0, 1]
    # The same generator state and thread count at the start of training, on every rank ...
    for s, p in zip(served["ranks"], plain["ranks"], strict=True):
        assert (s["rng"], s["threads"]) == (p["rng"], p["threads"])
    # ... and the same weights, to the bit (2 ranks on one machine: the sums are deterministic).
    assert served["weights"].keys() == plain["weights"].keys()
    for name, value in served["weights"].items():
        assert torch.equal(value, plain["weights"][name]), name
    # The seed matters (the check could fail): the first fit learned other weights.
    assert not torch.equal(first["weights"]["0.weight"], served["weights"]["0.weight"])


def test_a_stream_fit_of_forked_ranks_learns_what_plain_rank_processes_learn(spark, tmp_path):
    """data="stream": the spill's events reach a forked rank through the FIFO (issue 26)."""
    import torch

    from spark_estimators.store import LocalStore

    store = LocalStore(str(tmp_path / "store"))
    log_dir = tmp_path / "ranks"
    log_dir.mkdir()
    _seeded_fit(spark, store, 3, None, str(log_dir), data="stream")  # the zygote for the next fit
    served = _seeded_fit(spark, store, 5, None, str(log_dir), data="stream")
    plain = _seeded_fit(spark, store, 5, {"TORCH_SE_PLAIN_RANKS": "1"}, str(log_dir), "stream")
    assert [r["spare"] for r in served["ranks"]] == [True, True]
    assert [r["spare"] for r in plain["ranks"]] == [False, False]
    for name, value in served["weights"].items():
        assert torch.equal(value, plain["weights"][name]), name
    assert rank_processes() == []
