"""Rank start-up: time from a rank's Spark task start to its first optimizer step.

Usage:
    .venv/bin/python bench/startup.py --rounds 6

Runs ``TorchEstimator.fit`` on the horovod preset's data (100k x 10 floats, MLP 10-64-64-1,
Adam, 1 epoch, batch 256, 2 processes, local[2]) and alternates two cases in the same session,
so both see the same machine: the default rank (``torch._dynamo`` imported only when something
needs TorchDynamo, see ``spark_estimators/task/lazy_dynamo.py``) and the rank as before, with
``SPARK_ESTIMATORS_LAZY_DYNAMO=0`` in ``env=``. The first fit of the session is a warm-up (it
starts Spark's Python workers) and is not counted.

Per fit, from rank 0: task start -> the user's function starts (registration, rank process
start, fetching and unpickling the function), task start -> the first optimizer step (the
estimator's ``first_batch`` event, sent right after ``optimizer.step()``), and whether the rank
imported the real ``torch._dynamo``. Printed: each round, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fit import PRESETS, build_mlp  # noqa: E402

from spark_estimators.core.backend import SparkBackend  # noqa: E402


def timed(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs on the rank: report when the task started and the function began, then run it."""
    import sys
    import time

    from spark_estimators.task import context, send_event

    send_event("startup", {"task_started": context.task_started(), "fn_started": time.time()})
    try:
        return fn(*args, **kwargs)
    finally:
        module = sys.modules.get("torch._dynamo")
        real = module is not None and not module.__dict__.get("__se_stand_in__")
        send_event("dynamo", real)


class TimedBackend(SparkBackend):
    """Wraps the estimator's function in :func:`timed` and records the ranks' events."""

    def __init__(self, marks: dict[str, Any], **kwargs: Any):
        super().__init__(**kwargs)
        self.marks = marks

    def run(self, fn, args=(), kwargs=None, env=None, event_callback=None):  # type: ignore[override]
        def record(rank: int, kind: str, data: Any) -> None:
            if rank == 0 and kind in ("startup", "first_batch", "dynamo"):
                self.marks[kind] = data
            if event_callback is not None:
                event_callback(rank, kind, data)

        return super().run(timed, (fn, tuple(args), dict(kwargs or {})), None, env, record)


def fit_once(vdf: Any, lazy: bool) -> dict[str, float]:
    import torch

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    cfg = PRESETS["horovod"]
    tmp = tempfile.mkdtemp(prefix="bench-startup-")
    torch.manual_seed(0)
    model = build_mlp(cfg["features"], cfg["hidden"])
    marks: dict[str, Any] = {}
    env = {} if lazy else {"SPARK_ESTIMATORS_LAZY_DYNAMO": "0"}
    est = TorchEstimator(
        backend=TimedBackend(marks, num_proc=2, verbose=0, env=env),
        store=LocalStore(tmp),
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
    total = time.time() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    started = marks["startup"]["task_started"]
    return {
        "fn_s": marks["startup"]["fn_started"] - started,
        "first_step_s": float(marks["first_batch"]) - started,
        "total_s": total,
        "real_dynamo": float(bool(marks.get("dynamo"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    cfg = PRESETS["horovod"]
    nf = cfg["features"]
    df = spark.range(cfg["rows"], numPartitions=2).select(
        *[F.rand(seed=i).alias(f"f{i}") for i in range(nf)]
    )
    df = df.withColumn("y", sum(F.col(f"f{i}") * (i + 1) for i in range(nf)) / nf)
    assembler = VectorAssembler(inputCols=[f"f{i}" for i in range(nf)], outputCol="features")
    vdf = assembler.transform(df).select("features", "y").cache()
    vdf.count()
    fit_once(vdf, lazy=True)  # warm-up: Spark's Python workers, the prepared data's cache

    cases = {"lazy torch._dynamo (default)": True, "torch._dynamo imported (before)": False}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    print("rank 0, seconds from its Spark task's start; load average at start:", os.getloadavg())
    print(f"{'round':>5s} {'case':34s} {'fn starts':>9s} {'1st step':>9s} {'fit':>7s} dynamo")
    for rnd in range(1, args.rounds + 1):
        order = list(cases.items()) if rnd % 2 else list(reversed(cases.items()))
        for name, lazy in order:
            r = fit_once(vdf, lazy)
            results[name].append(r)
            print(
                f"{rnd:5d} {name:34s} {r['fn_s']:9.2f} {r['first_step_s']:9.2f} "
                f"{r['total_s']:7.2f} {'real' if r['real_dynamo'] else 'no'}",
                flush=True,
            )
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("fn_s", "first_step_s", "total_s")}
        for name, rs in results.items()
    }
    for name, m in med.items():
        print(
            f"median {name:34s} fn starts {m['fn_s']:.2f} s, first step {m['first_step_s']:.2f} s, "
            f"fit {m['total_s']:.2f} s"
        )
    new, old = (med[name] for name in cases)
    step_ratio = new["first_step_s"] / old["first_step_s"]
    print(
        f"first step after task start: {new['first_step_s']:.2f} s vs {old['first_step_s']:.2f} s "
        f"= {step_ratio:.2f}x; fit {new['total_s'] / old['total_s']:.2f}x"
    )
    print("load average at end:", os.getloadavg())
    spark.stop()


if __name__ == "__main__":
    main()
