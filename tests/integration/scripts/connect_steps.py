"""The steps the Connect test runs on a Spark Connect client and on a classic session alike."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import spark_estimators
from spark_estimators.errors import ConfigurationError

TRUE_W = [1.5, -2.0, 0.5, 3.0]


def rank_and_magic(magic_number):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # MASTER_ADDR, RANK, WORLD_SIZE are set for us
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank, magic_number, t.item()


def elastic_fn():
    import spark_estimators.collective as hvd

    hvd.init()
    total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum)
    return hvd.rank(), float(total[0])


def quickstart_df(spark):
    import pandas as pd
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = x @ np.array(TRUE_W) + 0.7
    pdf = pd.DataFrame({"f": list(x), "y": y})
    return spark.createDataFrame(pdf).select(array_to_vector(F.col("f")).alias("features"), "y")


def quickstart_estimator(store_dir: str, **kw: Any):
    import torch

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opts = dict(
        num_proc=2,
        store=LocalStore(store_dir),
        model=model,
        loss=torch.nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=5,
        validation=0.1,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def lightning_step(df, store_dir: str) -> dict:
    """The Lightning estimator's smoke test: fit, history, transform."""
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from spark_estimators.lightning import LightningEstimator
    from spark_estimators.store import LocalStore

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=2,
        store=LocalStore(store_dir),
        model=Linear(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    return _fitted_summary(est.fit(df), df, "train_loss")


def keras_step(df, store_dir: str) -> dict:
    """The Keras estimator's smoke test: fit, history, transform."""
    import keras

    from spark_estimators.keras import KerasEstimator
    from spark_estimators.store import LocalStore

    keras.utils.set_random_seed(0)
    est = KerasEstimator(
        num_proc=2,
        store=LocalStore(store_dir),
        model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    return _fitted_summary(est.fit(df), df, "loss")


def _fitted_summary(fitted, df, loss_key: str) -> dict:
    rows = fitted.transform(df).select("y", "y__output").collect()
    pred = np.array([np.ravel(r["y__output"])[0] for r in rows], dtype=float)
    target = np.array([r["y"] for r in rows], dtype=float)
    return {
        "history": [float(h[loss_key]) for h in fitted.getHistory()],
        "transform_mse": float(np.mean((pred - target) ** 2)),
        "n_rows": len(rows),
    }


def _error(fn) -> str:
    try:
        fn()
    except ConfigurationError as exc:
        return f"ConfigurationError: {exc}"
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type name
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_input(spark, tmp: str) -> dict:
    df = quickstart_df(spark)
    return {
        "missing_column": _error(
            lambda: quickstart_estimator(os.path.join(tmp, "bad"), feature_cols=["nope"]).fit(df)
        ),
        "too_many_ranks": _error(
            lambda: spark_estimators.run(rank_and_magic, args=(1,), num_proc=3, spark=spark)
        ),
    }


def all_steps(spark, tmp: str) -> dict:
    from pyspark.ml import Pipeline, PipelineModel

    out: dict = {}
    out["run"] = spark_estimators.run(rank_and_magic, args=(42,), num_proc=2, spark=spark)
    out["run_elastic"] = spark_estimators.run_elastic(elastic_fn, num_proc=2, spark=spark)
    df = quickstart_df(spark)
    est = quickstart_estimator(os.path.join(tmp, "store"))
    fitted = est.fit(df)
    out["history"] = [h["loss"] for h in fitted.getHistory()]
    out["val_history"] = [h["val_loss"] for h in fitted.getHistory()]
    out["weights"] = fitted.getModel().weight.detach().numpy().ravel().tolist()
    rows = fitted.transform(df).select("y", "y__output").collect()
    out["transform_mse"] = float(np.mean([(r["y"] - r["y__output"]) ** 2 for r in rows]))
    out["n_rows"] = len(rows)
    # fit_on_parquet on the dataset the fit prepared: trains without touching the DataFrame.
    again = quickstart_estimator(os.path.join(tmp, "store"), epochs=1).fit_on_parquet()
    out["fit_on_parquet_loss"] = again.getHistory()[-1]["loss"]
    # Pipeline save/load round trip.
    pipe = Pipeline(stages=[quickstart_estimator(os.path.join(tmp, "store2"), epochs=2)]).fit(df)
    path = os.path.join(tmp, "pipeline")
    pipe.save(path)
    loaded = PipelineModel.load(path)
    a = [r["y__output"] for r in pipe.transform(df).select("y__output").collect()]
    b = [r["y__output"] for r in loaded.transform(df).select("y__output").collect()]
    out["pipeline_max_diff"] = float(np.max(np.abs(np.array(a) - np.array(b))))
    out["bad_input"] = bad_input(spark, tmp)
    out["lightning"] = lightning_step(df, os.path.join(tmp, "lightning"))
    out["keras"] = keras_step(df, os.path.join(tmp, "keras"))
    return out
