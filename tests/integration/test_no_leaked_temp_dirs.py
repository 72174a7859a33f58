"""No temp dir survives a fit, a failed fit or the demo (issue 18).

Every fit runs with a fresh, empty temp dir: the driver's ``tempfile.tempdir`` points at it and
the ranks get ``TMPDIR`` through the backend's ``env`` (rank processes are fresh interpreters, so
they pick it up; the Spark session itself was started before and keeps its own dirs). The dir must
be empty again after the fit, whether it succeeded or failed. The failing fits fail on rank 1 only,
so rank 0 is killed by the abort while it waits in a collective (its ``finally`` never runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from pyspark.ml.linalg import Vectors

from spark_estimators.core.backend import SparkBackend
from spark_estimators.errors import TrainingFailedError
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4


#: Framework caches with one fixed name per user, reused by every process (not one per fit):
#: torch makes ``torchinductor_<user>`` when ``torch._dynamo`` is imported.
SHARED_CACHES = ("torchinductor_",)


def listing(root: str) -> list[str]:
    """Every path under ``root``, relative, sorted (files and dirs), shared caches left out."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            dirs[:] = [d for d in dirs if not d.startswith(SHARED_CACHES)]
        for name in dirs + files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, N_FEATURES))
    y = x @ np.array([1.5, -2.0, 0.5, 3.0])
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


@pytest.fixture
def fresh_tmp(spark, tmp_path, monkeypatch):
    """An empty temp dir for the driver (``tempfile.tempdir``) and, via ``env``, the ranks."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return str(root)


def common(fresh_tmp: str, tmp_path, **kw):
    opts = dict(
        backend=SparkBackend(num_proc=2, env={"TMPDIR": fresh_tmp}, verbose=0),
        store=LocalStore(str(tmp_path / "store")),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=2,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return opts


# --------------------------------------------------------------------------------- torch
def torch_estimator(fresh_tmp, tmp_path, model):
    import torch

    from spark_estimators.torch import TorchEstimator

    return TorchEstimator(
        **common(fresh_tmp, tmp_path),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
    )


def _torch_modules():
    torch = pytest.importorskip("torch")

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(N_FEATURES, 1)

        def forward(self, x):
            return self.fc(x)

    class FailsOnRankOne(Linear):
        def forward(self, x):
            if os.environ.get("SPARK_ESTIMATORS_RANK") == "1":
                raise RuntimeError("planted failure on rank 1")
            return self.fc(x)

    return Linear, FailsOnRankOne


def test_torch_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    linear, _ = _torch_modules()
    model = torch_estimator(fresh_tmp, tmp_path, linear()).fit(df)
    assert len(model.getHistory()) == 2  # the fit really ran (2 epochs)
    assert listing(fresh_tmp) == []


def test_failed_torch_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    _, failing = _torch_modules()
    with pytest.raises(TrainingFailedError, match="planted failure on rank 1"):
        torch_estimator(fresh_tmp, tmp_path, failing()).fit(df)
    assert listing(fresh_tmp) == []


# ----------------------------------------------------------------------------- lightning
def _lightning_modules():
    pl = pytest.importorskip("pytorch_lightning")
    torch = pytest.importorskip("torch")

    class LinearModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(N_FEATURES, 1)

        def forward(self, x):
            return self.fc(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class FailsOnRankOne(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.global_rank == 1:
                raise RuntimeError("planted failure on rank 1")
            return super().training_step(batch, batch_idx)

    return LinearModule, FailsOnRankOne


def lightning_estimator(fresh_tmp, tmp_path, module):
    from spark_estimators.lightning import LightningEstimator

    return LightningEstimator(**common(fresh_tmp, tmp_path), model=module)


def test_lightning_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    module, _ = _lightning_modules()
    model = lightning_estimator(fresh_tmp, tmp_path, module()).fit(df)
    assert len(model.getHistory()) == 2
    assert listing(fresh_tmp) == []


def test_failed_lightning_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    _, failing = _lightning_modules()
    with pytest.raises(TrainingFailedError, match="planted failure on rank 1"):
        lightning_estimator(fresh_tmp, tmp_path, failing()).fit(df)
    assert listing(fresh_tmp) == []


# --------------------------------------------------------------------------------- keras
def keras_estimator(fresh_tmp, tmp_path, callbacks=()):
    keras = pytest.importorskip("keras")
    from spark_estimators.keras import KerasEstimator

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((N_FEATURES,)), keras.layers.Dense(1)])
    return KerasEstimator(
        **common(fresh_tmp, tmp_path),
        model=model,
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        callbacks=list(callbacks),
    )


def test_keras_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    fitted = keras_estimator(fresh_tmp, tmp_path).fit(df)
    assert len(fitted.getHistory()) == 2
    assert listing(fresh_tmp) == []


def test_failed_keras_fit_leaves_no_temp_dir(df, fresh_tmp, tmp_path):
    keras = pytest.importorskip("keras")

    class FailsOnRankOne(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            # Epoch 1 on rank 1: rank 0 has checkpointed epoch 0 and waits in a collective.
            if epoch == 1 and os.environ.get("SPARK_ESTIMATORS_RANK") == "1":
                raise RuntimeError("planted failure on rank 1")

    est = keras_estimator(fresh_tmp, tmp_path, [FailsOnRankOne()])
    with pytest.raises(TrainingFailedError, match="planted failure on rank 1"):
        est.fit(df)
    assert listing(fresh_tmp) == []


# ---------------------------------------------------------------------------------- demo
@pytest.mark.slow  # the whole demo: its own JVM, 20k rows, 6 epochs (1-4 min on 2 cores)
@pytest.mark.timeout(400)
def test_demo_leaves_no_temp_dir(tmp_path):
    pytest.importorskip("torch")
    fresh = tmp_path / "tmp"
    fresh.mkdir()
    env = dict(os.environ, TMPDIR=str(fresh))
    env.pop("SPARK_ESTIMATORS_TEST_SESSION", None)  # its rank processes are its own business
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.demo"],
        capture_output=True,
        text=True,
        timeout=380,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "R^2 = " in proc.stdout
    # issue 41: each epoch line once (the summary used to print them all again)
    epochs = [ln for ln in proc.stdout.splitlines() if re.search(r"\bepoch \d+/6\b", ln)]
    assert [ln.split(":")[0] for ln in epochs] == [f"epoch {i}/6" for i in range(1, 7)]
    assert listing(str(fresh)) == []


# ------------------------------------------------------------------------- default store
def test_default_store_is_removed_when_the_driver_exits(tmp_path):
    """Without ``store=`` the fit's store is a temp dir; it goes away with the interpreter."""
    fresh = tmp_path / "tmp"
    fresh.mkdir()
    code = (
        "from spark_estimators.torch import TorchEstimator\n"
        "store = TorchEstimator()._store()\n"
        "import os; assert os.path.isdir(store.prefix_path)\n"
        "print(store.prefix_path)\n"
    )
    env = dict(os.environ, TMPDIR=str(fresh))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    made = proc.stdout.strip().splitlines()[-1]
    assert made.startswith(str(fresh))
    assert not os.path.exists(made)
    assert listing(str(fresh)) == []
