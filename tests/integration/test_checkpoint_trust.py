"""Checkpoints from the store are loaded weights-only (issue 18, trust boundary).

Each test plants an object whose ``__reduce__`` creates a marker file into a checkpoint, then lets
the estimator load it. The ranks run with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which makes
torch 2.13 behave as torch < 2.6 (still allowed by pyproject) where ``torch.load`` defaulted to
``weights_only=False``: only an explicit ``weights_only=True`` refuses the planted object.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

import torch.nn.functional as F  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402

from spark_estimators.core.backend import SparkBackend  # noqa: E402
from spark_estimators.errors import TrainingFailedError  # noqa: E402
from spark_estimators.lightning import LightningEstimator  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

OLD_TORCH_DEFAULT = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


class Planted:
    """Unpickling this creates ``marker``: what an attacker's payload would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_into(path: str, marker: str) -> None:
    """Add a planted object to the checkpoint at ``path``, keeping everything else."""
    state = torch.load(path, weights_only=True)
    state["planted"] = Planted(marker)
    torch.save(state, path)


class LinearModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class PlantIntoBest(pl.Callback):
    """At the end of the fit, plants an object into the best checkpoint the estimator reloads."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_fit_end(self, trainer, pl_module):
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor is not None:
                plant_into(cb.best_model_path, self.marker)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("trust-store")))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2))
    y = x @ np.array([1.0, -1.0])
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


def torch_estimator(store, epochs):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TorchEstimator(
        backend=SparkBackend(num_proc=1, env=OLD_TORCH_DEFAULT, verbose=0),
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=epochs,
        run_id="torch_planted",
        verbose=0,
    )


def lightning_estimator(store, epochs, run_id, callbacks=()):
    torch.manual_seed(0)
    return LightningEstimator(
        backend=SparkBackend(num_proc=1, env=OLD_TORCH_DEFAULT, verbose=0),
        store=store,
        model=LinearModule(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=epochs,
        run_id=run_id,
        callbacks=list(callbacks),
        verbose=0,
    )


def test_torch_hot_start_refuses_a_planted_checkpoint(df, store, tmp_path):
    torch_estimator(store, epochs=1).fit(df)
    ckpt = os.path.join(store.get_checkpoint_path("torch_planted"), "checkpoint.pt")
    marker = tmp_path / "pwned"
    plant_into(ckpt, str(marker))
    with pytest.raises(TrainingFailedError, match=r"refused to load checkpoint .*checkpoint\.pt"):
        torch_estimator(store, epochs=2).fit(df)
    assert not marker.exists(), "the planted payload ran on the rank"


def test_lightning_hot_start_refuses_a_planted_checkpoint(df, store, tmp_path):
    lightning_estimator(store, epochs=1, run_id="lightning_planted").fit(df)
    ckpt = os.path.join(store.get_checkpoint_path("lightning_planted"), "last_epoch.ckpt")
    marker = tmp_path / "pwned"
    plant_into(ckpt, str(marker))
    with pytest.raises(TrainingFailedError, match=r"Weights only load failed|refused to load"):
        lightning_estimator(store, epochs=2, run_id="lightning_planted").fit(df)
    assert not marker.exists(), "the planted payload ran on the rank"


def test_lightning_best_checkpoint_is_reloaded_weights_only(df, store, tmp_path):
    marker = tmp_path / "pwned"
    callbacks = [ModelCheckpoint(monitor="train_loss"), PlantIntoBest(str(marker))]
    est = lightning_estimator(store, epochs=1, run_id="lightning_best", callbacks=callbacks)
    with pytest.raises(TrainingFailedError, match=r"refused to load checkpoint .*\.ckpt"):
        est.fit(df)
    assert not marker.exists(), "the planted payload ran on the rank"
