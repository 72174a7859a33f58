"""Where a fit's time goes, and the first-step latency of the first and of later fits.

Usage:
    .venv/bin/python bench/startup.py --rounds 4

Runs ``TorchEstimator.fit`` on the horovod preset's data (100k x 10 floats, MLP 10-64-64-1,
Adam, 1 epoch, batch 256, 2 processes, local[2]) in one session: the session's first fit
(Spark's Python workers still cold), then ``--rounds`` later fits, each on a new DataFrame (a
different filter, so ``prepare_data`` writes every time, as each fold of a CrossValidator
does) followed by one on the same DataFrame again (the prepared data is reused: no write).

Per fit, wall clock on this machine (driver and ranks share the clock), rank 0's view:

- ``prep``: ``prepare_data`` (the Parquet write; ~0 when reused);
- ``pre-launch``: prepare_data's end -> the backend's ``run`` (spec building, pickling);
- ``job->task``: ``run`` called -> rank 0's Spark task starts (driver service, job submission,
  scheduling the barrier stage);
- ``task->fn``: the task starts -> the user's function starts (registration, rank process
  start, fetching and unpickling the function);
- ``fn->step``: the function starts -> the first optimizer step (import torch, unpickle the
  model, join the process group, open the readers, the first batch);
- ``tail``: the first step -> ``fit`` returns (the epoch, results, the model);
- ``job->step``: ``run`` called -> the first optimizer step (the issue's "first optimizer step
  after its Spark job starts").

``--trace`` prints, per fit, rank 0's start-up steps in seconds after ``run`` (the marks of
:func:`spark_estimators.task.context.mark`: the zygote's start and end of imports,
registration, the fork, config read, function fetched/unpickled, process group joined, user
objects loaded, parameters broadcast, readers open, first step). ``--spares 0`` sets
``SPARK_ESTIMATORS_SPARE_RANKS=0`` for the session (plain rank processes, no zygote).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fit import PRESETS, build_data, build_mlp  # noqa: E402

from spark_estimators.core.backend import SparkBackend  # noqa: E402
from spark_estimators.task import spare  # noqa: E402

TRACE = False
PHASES = ("prep", "pre-launch", "job->task", "task->fn", "fn->step", "tail", "job->step", "fit")


def timed(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs on the rank: report when the task started and the function began, then run it."""
    import time

    from spark_estimators.task import context, send_event

    send_event("startup", {"task_started": context.task_started(), "fn_started": time.time()})
    try:
        return fn(*args, **kwargs)
    finally:
        send_event("marks", context.marks())


class TimedBackend(SparkBackend):
    """Wraps the estimator's function in :func:`timed` and records the ranks' events."""

    def __init__(self, marks: dict[str, Any], **kwargs: Any):
        super().__init__(**kwargs)
        self.marks = marks

    def run(self, fn, args=(), kwargs=None, env=None, event_callback=None, **extra):  # type: ignore[override]
        self.marks["run"] = time.time()

        def record(rank: int, kind: str, data: Any) -> None:
            if rank == 0 and kind in ("startup", "first_batch", "marks"):
                self.marks[kind] = data
            if event_callback is not None:
                event_callback(rank, kind, data)

        wrapped = partial(timed)  # keeps the estimator's zygote imports
        setattr(wrapped, spare.PREIMPORT_ATTR, spare.preimports(fn))
        args = (fn, tuple(args), dict(kwargs or {}))
        return super().run(wrapped, args, None, env, record, **extra)


def install_prepare_timer(marks: dict[str, Any]) -> None:
    """Time ``prepare_data`` (the estimator imports it from ``spark_estimators.data`` per fit)."""
    import spark_estimators.data as data

    original = data.prepare_data

    def prepare_data(*args: Any, **kwargs: Any) -> Any:
        marks["prep_start"] = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            marks["prep_end"] = time.time()

    data.prepare_data = prepare_data  # type: ignore[assignment]


def fit_once(vdf: Any, store_dir: str, marks: dict[str, Any]) -> dict[str, float]:
    import torch

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    cfg = PRESETS["horovod"]
    torch.manual_seed(0)
    model = build_mlp(cfg["features"], cfg["hidden"])
    marks.clear()
    est = TorchEstimator(
        backend=TimedBackend(marks, num_proc=2, verbose=0),
        store=LocalStore(store_dir),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=256,
        epochs=1,
        verbose=0,
    )
    t0 = time.time()
    est.fit(vdf)
    end = time.time()
    task, fn = marks["startup"]["task_started"], marks["startup"]["fn_started"]
    step = float(marks["first_batch"])
    if TRACE:
        steps = sorted([*marks.get("marks", ()), ("task_started", task), ("fn_started", fn)])
        steps = [(t, n) for n, t in steps] + [(step, "first_step")]
        print(
            "  rank 0, s after run():",
            ", ".join(f"{n} {t - marks['run']:+.2f}" for t, n in sorted(steps)),
        )
    prep_end = marks.get("prep_end", t0)
    return {
        "prep": prep_end - marks.get("prep_start", t0),
        "pre-launch": marks["run"] - prep_end,
        "job->task": task - marks["run"],
        "task->fn": fn - task,
        "fn->step": step - fn,
        "tail": end - step,
        "job->step": step - marks["run"],
        "fit": end - t0,
    }


def show(label: str, r: dict[str, float]) -> None:
    print(f"{label:22s} " + " ".join(f"{r[p]:10.2f}" for p in PHASES), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--trace", action="store_true", help="print rank 0's start-up steps (task/context.marks)"
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=None,
        help="SPARK_ESTIMATORS_SPARE_RANKS for the session (0: no zygote, plain rank processes)",
    )
    args = parser.parse_args()
    if args.spares is not None:
        os.environ[spare.SPARE_ENV] = str(args.spares)  # local[2]: the workers inherit it
    global TRACE
    TRACE = args.trace

    from pyspark.sql import functions as F

    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    cfg = PRESETS["horovod"]
    _, vdf = build_data(spark, cfg["rows"], cfg["features"])
    marks: dict[str, Any] = {}
    install_prepare_timer(marks)
    root = tempfile.mkdtemp(prefix="bench-startup-")
    print("load average at start:", os.getloadavg(), "zygotes:", spare.enabled())
    print(f"{'fit':22s} " + " ".join(f"{p:>10s}" for p in PHASES))
    show("first of the session", fit_once(vdf, os.path.join(root, "s0"), marks))
    written, reused = [], []
    for rnd in range(1, args.rounds + 1):
        df = vdf.where(F.col("y") > -float(rnd))  # a new plan: prepare_data writes again
        store = os.path.join(root, f"s{rnd}")
        written.append(fit_once(df, store, marks))
        show(f"later, new data {rnd}", written[-1])
        reused.append(fit_once(df, store, marks))
        show(f"later, same data {rnd}", reused[-1])
    for label, rows in (("median new data", written), ("median same data", reused)):
        show(label, {p: statistics.median(r[p] for r in rows) for p in PHASES})
    print("load average at end:", os.getloadavg())
    shutil.rmtree(root, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
