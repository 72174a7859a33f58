"""data="stream" fits of the three estimators, run on a classic session and a Connect client.

Each step builds its estimator with ``data="stream"`` (no store unless given) on the same small
linear-regression DataFrame and returns the loss history, the validation loss and the transform
error, which the tests check.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TRUE_W = [1.5, -2.0, 0.5, 3.0]


def make_df(spark: Any, n: int = 600) -> Any:
    """``features`` (4 dense values), ``y`` linear in them, ``is_val`` every 5th row."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4))
    y = x @ np.array(TRUE_W) + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), i % 5 == 0) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y", "is_val"])


def torch_stream(df: Any) -> dict:
    import torch

    from spark_estimators.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    est = TorchEstimator(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
        validation="is_val",
        data="stream",
    )
    return summary(est.fit(df), df, "loss")


def lightning_stream(df: Any) -> dict:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from spark_estimators.lightning import LightningEstimator

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

        def validation_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=2,
        model=Linear(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
        validation="is_val",
        data="stream",
    )
    return summary(est.fit(df), df, "train_loss")


def keras_stream(df: Any) -> dict:
    import keras

    from spark_estimators.keras import KerasEstimator

    keras.utils.set_random_seed(0)
    est = KerasEstimator(
        num_proc=2,
        model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
        validation="is_val",
        data="stream",
    )
    return summary(est.fit(df), df, "loss")


def summary(fitted: Any, df: Any, loss_key: str) -> dict:
    rows = fitted.transform(df).select("y", "y__output").collect()
    pred = np.array([np.ravel(r["y__output"])[0] for r in rows], dtype=float)
    target = np.array([r["y"] for r in rows], dtype=float)
    history = fitted.getHistory()
    return {
        "history": [float(h[loss_key]) for h in history],
        "val_loss": float(history[-1].get("val_loss", float("nan"))),
        "transform_mse": float(np.mean((pred - target) ** 2)),
        "n_rows": len(rows),
    }


def all_steps(spark: Any) -> dict:
    df = make_df(spark)
    return {
        "torch": torch_stream(df),
        "lightning": lightning_stream(df),
        "keras": keras_stream(df),
    }
