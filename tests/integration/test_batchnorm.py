"""Models with BatchNorm fit on 2 ranks in all three estimators (issue 31).

Each rank updates BatchNorm's running statistics from its own batches, so they legitimately
differ at the end of a fit while the parameters are equal. The fit must succeed, return rank 0's
statistics (horovod's behaviour), predict, save/load and hot-start; ``average_running_stats=True``
makes the returned statistics the mean over the ranks. A real divergence of the parameters still
fails the fit.

Each rank records its statistics into a shared local directory: after its last epoch (before any
averaging) and at ``on_train_end`` (after it).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml import PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators import envvars  # noqa: E402
from spark_estimators.errors import TrainingFailedError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 8
ROWS = 256


def _rank() -> int:
    return int(os.environ[envvars.SE_RANK])


def _save_stats(out_dir: str, stage: str, stats: list[np.ndarray]) -> None:
    np.savez(os.path.join(out_dir, f"{stage}{_rank()}.npz"), *stats)


def load_stats(out_dir, stage):
    """``[rank 0's arrays, rank 1's arrays]`` recorded at ``stage`` ("pre" or "post")."""
    out = []
    for r in range(2):
        with np.load(os.path.join(out_dir, f"{stage}{r}.npz")) as z:
            out.append([z[f"arr_{i}"] for i in range(len(z.files))])
    return out


def assert_stats_equal(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def assert_stats_differ(a, b):
    assert any(not np.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b, strict=True))


def check_running_stats(out_dir, returned, averaged):
    """The ranks' statistics before/after the end of training against the returned model's."""
    pre, post = load_stats(out_dir, "pre"), load_stats(out_dir, "post")
    # Each rank saw its own batches: the statistics differ between the ranks before the end.
    assert_stats_differ(pre[0], pre[1])
    if averaged:
        mean = [(x + y) / 2 for x, y in zip(pre[0], pre[1], strict=True)]
        assert_stats_equal(post[0], mean)
        assert_stats_equal(post[1], mean)
        assert_stats_equal(returned, mean)
    else:
        assert_stats_equal(post[0], pre[0])
        assert_stats_equal(post[1], pre[1])
        assert_stats_equal(returned, pre[0])  # rank 0's, as horovod returns


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(7)
    # Offset and scaled features: BatchNorm's statistics are far from its initial 0 / 1.
    x = rng.normal(loc=3.0, scale=2.0, size=(ROWS, N_FEATURES))
    w = rng.normal(size=N_FEATURES)
    y = (x - 3.0) @ w / 2.0
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), i) for i in range(ROWS)]
    return spark.createDataFrame(rows, ["features", "y", "id"]).cache()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("batchnorm-store")))


def features_of(df):
    rows = df.orderBy("id").collect()
    return np.array([r["features"].toArray() for r in rows], dtype=np.float32), rows


def assert_save_load_round_trip(model, df, tmp_path, model_cls):
    path = str(tmp_path / "pm")
    PipelineModel(stages=[model]).write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[0], model_cls)
    a = [r["y__output"] for r in model.transform(df).orderBy("id").collect()]
    b = [r["y__output"] for r in loaded.transform(df).orderBy("id").collect()]
    np.testing.assert_allclose(a, b, rtol=1e-6)
    return loaded


# -- torch ----------------------------------------------------------------------------------------
def bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 1),
    )


def torch_stats(module):
    from spark_estimators.torch.running_stats import running_stat_buffers

    return [b.detach().cpu().numpy().copy() for b in running_stat_buffers(module)]


class TorchStatsRecorder:
    """A TorchEstimator callback; pickled with the model, so ``self.model`` is the rank's model."""

    def __init__(self, model, out_dir):
        self.model, self.out_dir = model, out_dir

    def on_epoch_end(self, epoch, logs):
        _save_stats(self.out_dir, "pre", torch_stats(self.model))

    def on_train_end(self, logs):
        _save_stats(self.out_dir, "post", torch_stats(self.model))


def torch_estimator(store_, out_dir, **kw):
    from spark_estimators.torch import TorchEstimator

    model = kw.pop("model", None) or bn_net()
    opts = dict(
        num_proc=2,
        store=store_,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        random_seed=1,
        verbose=0,
        callbacks=[TorchStatsRecorder(model, out_dir)] if out_dir else [],
    )
    opts.update(kw)
    return TorchEstimator(**opts)


@pytest.fixture(scope="module")
def torch_fitted(df, store, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("torch-bn"))
    return torch_estimator(store, out_dir, run_id="torch_bn").fit(df), out_dir


def test_torch_batchnorm_fits_and_returns_rank_zeros_statistics(torch_fitted, df):
    model, out_dir = torch_fitted
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1]
    assert history["loss"][-1] < history["loss"][0]
    net = model.getModel()
    check_running_stats(out_dir, torch_stats(net), averaged=False)
    # transform is the returned module in eval mode (running statistics), row for row.
    x, rows = features_of(df)
    got = np.array([r["y__output"] for r in model.transform(df).orderBy("id").collect()])
    with torch.no_grad():
        want = net.eval()(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(rows) == ROWS


def test_torch_batchnorm_save_load_and_hot_start(torch_fitted, df, store, tmp_path):
    from spark_estimators.torch import TorchModel

    model, _ = torch_fitted
    loaded = assert_save_load_round_trip(model, df, tmp_path, TorchModel)
    assert_stats_equal(torch_stats(loaded.stages[0].getModel()), torch_stats(model.getModel()))
    resumed = torch_estimator(store, None, run_id="torch_bn", epochs=3).fit(df)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1, 2]
    assert resumed.getHistory()[:2] == model.getHistory()


def test_torch_average_running_stats(df, store, tmp_path):
    est = torch_estimator(store, str(tmp_path), average_running_stats=True)
    assert est.getAverageRunningStats() is True
    model = est.fit(df)
    check_running_stats(str(tmp_path), torch_stats(model.getModel()), averaged=True)


class DriftOnRankOne(torch.nn.Module):
    """Rank 1 moves a parameter outside the optimizer: a real divergence of the ranks."""

    def __init__(self):
        super().__init__()
        self.net = bn_net()

    def forward(self, x):
        if self.training and _rank() == 1:
            with torch.no_grad():
                self.net[0].bias.add_(1e-3)
        return self.net(x)


def test_diverged_parameters_still_fail_the_fit(df, store):
    model = DriftOnRankOne()
    est = torch_estimator(store, None, model=model, epochs=1)
    est.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    with pytest.raises(TrainingFailedError, match=r"different weights \(2 distinct: ranks \[0\]"):
        est.fit(df)


# -- Lightning ------------------------------------------------------------------------------------
def _lightning():
    return pytest.importorskip("pytorch_lightning")


def lightning_module_cls():
    pl = _lightning()
    import torch.nn.functional as F

    class BNModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = bn_net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class StatsRecorder(pl.Callback):
        def __init__(self, out_dir):
            self.out_dir = out_dir

        def on_train_epoch_end(self, trainer, pl_module):
            _save_stats(self.out_dir, "pre", torch_stats(pl_module))

        def on_train_end(self, trainer, pl_module):
            _save_stats(self.out_dir, "post", torch_stats(pl_module))

    return BNModule, StatsRecorder


def lightning_estimator(store_, out_dir, **kw):
    from spark_estimators.lightning import LightningEstimator

    module_cls, recorder_cls = lightning_module_cls()
    opts = dict(
        num_proc=2,
        store=store_,
        model=module_cls(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        random_seed=1,
        verbose=0,
        callbacks=[recorder_cls(out_dir)] if out_dir else [],
    )
    opts.update(kw)
    return LightningEstimator(**opts)


def test_lightning_batchnorm_fit_transform_save_load_hot_start(df, store, tmp_path):
    from spark_estimators.lightning import LightningModel

    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    model = lightning_estimator(store, str(out_dir), run_id="lightning_bn").fit(df)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1]
    assert history["train_loss"][-1] < history["train_loss"][0]
    net = model.getModel()
    check_running_stats(str(out_dir), torch_stats(net), averaged=False)
    x, _ = features_of(df)
    got = np.array([r["y__output"] for r in model.transform(df).orderBy("id").collect()])
    with torch.no_grad():
        want = net.eval()(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_save_load_round_trip(model, df, tmp_path, LightningModel)
    resumed = lightning_estimator(store, None, run_id="lightning_bn", epochs=3).fit(df)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1, 2]


def test_lightning_average_running_stats(df, store, tmp_path):
    model = lightning_estimator(store, str(tmp_path), average_running_stats=True).fit(df)
    check_running_stats(str(tmp_path), torch_stats(model.getModel()), averaged=True)


# -- Keras ----------------------------------------------------------------------------------------
def _keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("keras")


def keras_bn_model():
    keras = _keras()
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((N_FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1),
        ]
    )


def keras_stats(model):
    from spark_estimators.keras.callbacks import moving_statistics

    return [np.asarray(v.numpy()).copy() for v in moving_statistics(model)]


def keras_recorder(out_dir):
    keras = _keras()

    class StatsRecorder(keras.callbacks.Callback):
        def __init__(self, out_dir):
            super().__init__()
            self.out_dir = out_dir

        def on_epoch_end(self, epoch, logs=None):
            _save_stats(self.out_dir, "pre", keras_stats(self.model))
            weights = [np.asarray(w.numpy()) for w in self.model.trainable_weights]
            np.savez(os.path.join(self.out_dir, f"weights{_rank()}_{epoch}.npz"), *weights)

        def on_train_end(self, logs=None):
            _save_stats(self.out_dir, "post", keras_stats(self.model))

    return StatsRecorder(out_dir)


def keras_estimator(store_, out_dir, **kw):
    keras = _keras()
    from spark_estimators.keras import KerasEstimator

    opts = dict(
        num_proc=2,
        store=store_,
        model=keras_bn_model(),
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        random_seed=1,
        verbose=0,
        callbacks=[keras_recorder(out_dir)] if out_dir else [],
    )
    opts.update(kw)
    return KerasEstimator(**opts)


def test_keras_batchnorm_fit_transform_save_load_hot_start(df, store, tmp_path):
    from spark_estimators.keras import KerasModel

    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    model = keras_estimator(store, str(out_dir), run_id="keras_bn").fit(df)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1]
    assert history["loss"][-1] < history["loss"][0]
    net = model.getModel()
    check_running_stats(str(out_dir), keras_stats(net), averaged=False)
    x, _ = features_of(df)
    got = np.array([r["y__output"] for r in model.transform(df).orderBy("id").collect()])
    want = net.predict(x, verbose=0).ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_save_load_round_trip(model, df, tmp_path, KerasModel)
    resumed = keras_estimator(store, None, run_id="keras_bn", epochs=3).fit(df)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1, 2]


def test_keras_average_running_stats(df, store, tmp_path):
    model = keras_estimator(store, str(tmp_path), average_running_stats=True).fit(df)
    check_running_stats(str(tmp_path), keras_stats(model.getModel()), averaged=True)


def test_keras_best_model_checkpoint_returns_the_best_epoch(df, store, tmp_path):
    from spark_estimators.collective.keras.callbacks import BestModelCheckpoint

    # "Best" = the highest loss: epoch 0, so the returned model is not the last epoch's.
    best = BestModelCheckpoint(monitor="loss", mode="max")
    assert best.save_best_only and best.monitor == "loss"
    model = keras_estimator(
        store, str(tmp_path), epochs=3, checkpoint_callback=best, run_id="keras_best"
    ).fit(df)
    history = model.getHistory()
    assert history["loss"][0] == max(history["loss"])
    returned = [np.asarray(w.numpy()) for w in model.getModel().trainable_weights]
    with np.load(os.path.join(str(tmp_path), "weights0_0.npz")) as z:
        epoch0 = [z[f"arr_{i}"] for i in range(len(z.files))]
    with np.load(os.path.join(str(tmp_path), "weights0_2.npz")) as z:
        last = [z[f"arr_{i}"] for i in range(len(z.files))]
    assert_stats_equal(returned, epoch0)
    assert_stats_differ(returned, last)
    assert "best_model.keras" in store.listdir(store.get_checkpoint_path("keras_best"))
