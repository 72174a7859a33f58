"""horovod 0.28.1's ``horovod.spark.torch.TorchEstimator`` on bench/fit.py's horovod preset.

Run by the python of a separate horovod virtualenv (recipe in bench/README.md), never by the
project's: horovod 0.28.1 needs pyarrow < 11 and numpy < 2, which cannot share a virtualenv
with ours.

Usage:
    /work/venv-hvd/bin/python bench/fit_horovod.py --rounds 6   # prints total seconds per round
    /work/venv-hvd/bin/python bench/fit_horovod.py --serve      # driven by bench/fit.py

The data and model are bench/fit.py's horovod preset: 100k x 10 floats from ``F.rand(seed=i)``
as one vector column (``VectorAssembler``), ``y = sum(f_i * (i + 1)) / 10``, cached; MLP
10-64-64-1 (``torch.manual_seed(0)``), Adam lr 1e-3, MSE, 2 epochs, batch 256, ``num_proc=2``
on local[2], a fresh ``LocalStore`` per run (so horovod's ``prepare_data`` writes its Parquet
each run, as ours does). Total seconds are wall clock from ``fit`` to its return.

``--serve`` keeps one warm Spark session across rounds (as bench/fit.py keeps its own): it
prints ``READY`` once the data is cached, then runs one fit per ``fit`` line read from stdin
and answers each with one ``RESULT {json}`` line (``total_s``, ``loss``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from typing import Any

from fit import BATCH, PRESETS, build_data, build_mlp  # bench/fit.py, beside this file

_PRESET = PRESETS["horovod"]
ROWS, FEATURES, EPOCHS = _PRESET["rows"], _PRESET["features"], _PRESET["epochs"]
HIDDEN: list[int] = _PRESET["hidden"]


def fit_once(vdf: Any) -> dict[str, float]:
    import torch
    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    tmp = tempfile.mkdtemp(prefix="bench-hvd-")
    torch.manual_seed(0)
    model = build_mlp(FEATURES, HIDDEN)
    est = TorchEstimator(
        num_proc=2,
        store=Store.create(tmp),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        input_shapes=[[-1, FEATURES]],
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        use_gpu=False,
    )
    t0 = time.time()
    fitted = est.fit(vdf)
    total = time.time() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    last = fitted.getHistory()[-1]
    loss = last.get("train", last).get("loss", float("nan"))
    return {"total_s": total, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--serve", action="store_true", help="one fit per 'fit' line on stdin")
    args = parser.parse_args()

    import os

    from pyspark.sql import SparkSession

    # Spark's Python workers must be this virtualenv's python (the one with horovod), whatever
    # PYSPARK_PYTHON the caller's environment names
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = SparkSession.builder.master("local[2]").appName("bench-fit-horovod").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    _, vdf = build_data(spark, ROWS, FEATURES)
    if args.serve:
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() != "fit":
                break
            print("RESULT " + json.dumps(fit_once(vdf)), flush=True)
    else:
        totals = []
        for rnd in range(1, args.rounds + 1):
            r = fit_once(vdf)
            totals.append(r["total_s"])
            print(f"round {rnd}: horovod {r['total_s']:.2f} s, loss {r['loss']:.4f}", flush=True)
        print("horovod totals: " + ", ".join(f"{t:.2f}" for t in totals))
    spark.stop()


if __name__ == "__main__":
    main()
