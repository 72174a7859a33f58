"""LightningEstimator end to end on real Spark with 2 processes and small data."""

from __future__ import annotations

import os

import numpy as np
import pytest

pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402
from pytorch_lightning.callbacks import EarlyStopping  # noqa: E402

from spark_estimators.errors import ConfigurationError, TrainingFailedError  # noqa: E402
from spark_estimators.lightning import (  # noqa: E402
    LightningEstimator,
    LightningModel,
    TorchEstimator,
    TorchModel,
)
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])
BATCH = 32


class LinearModule(pl.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.fc = torch.nn.Linear(N_FEATURES, 1)

    def forward(self, x):
        return self.fc(x)

    def _loss(self, batch):
        return F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RankDivergentModule(LinearModule):
    """Logs a rank-local metric: it improves on rank 0 and stalls on rank 1 from epoch 1."""

    def training_step(self, batch, batch_idx):
        sign = 1.0 if self.global_rank == 1 else -1.0
        self.log("divergent", sign * self.current_epoch, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class NaNAtEpochOne(LinearModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.current_epoch == 1 else loss


class RankRecorder(pl.Callback):
    """Each rank saves what it saw (batch layout, epochs, final weights) to a shared local dir."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.first_batch = None
        self.batches = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = {k: (list(v.shape), str(v.dtype)) for k, v in batch.items()}
        epoch = trainer.current_epoch
        self.batches[epoch] = self.batches.get(epoch, 0) + 1

    def on_fit_end(self, trainer, pl_module):
        torch.save(
            {
                "state": {k: v.detach().cpu() for k, v in pl_module.state_dict().items()},
                "first_batch": self.first_batch,
                "batches": self.batches,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


class KillOnceMidEpoch(pl.Callback):
    """Rank 1 SIGKILLs itself at step 2 of ``epoch`` unless ``clock`` exists; rank 0 logs epochs."""

    def __init__(self, epoch, clock, epochs_log):
        self.epoch, self.clock, self.epochs_log = epoch, clock, epochs_log

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(self.epochs_log, "a") as f:
                f.write(f"{trainer.current_epoch}\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import signal
        import time

        if (
            trainer.current_epoch == self.epoch
            and batch_idx == 2
            and trainer.global_rank == 1
            and not os.path.exists(self.clock)
        ):
            with open(self.clock, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def load_ranks(out_dir):
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def make_estimator(store_, module=None, **kw):
    torch.manual_seed(0)
    opts = dict(
        num_proc=2,
        store=store_,
        model=module if module is not None else LinearModule(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=BATCH,
        epochs=4,
        random_seed=1,
        log_every_n_steps=1,
        verbose=0,
    )
    opts.update(kw)
    return LightningEstimator(**opts)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("lightning-store")))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    n = 512
    x = rng.normal(size=(n, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), float(x[i, 0])) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y", "x0"]).cache()


@pytest.fixture(scope="module")
def fitted(df, store, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("ranks-main"))
    est = make_estimator(
        store, validation=0.25, run_id="fit_main", callbacks=[RankRecorder(out_dir)]
    )
    return est, est.fit(df), out_dir


def test_loss_decreases_and_history_holds_rank_averaged_metrics(fitted):
    _, model, _ = fitted
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.05 < history[0]["loss"]
    assert history[-1]["val_loss"] < 0.05
    # "loss" is the mean training_step loss; the module also logged its epoch mean (sync_dist).
    for h in history:
        assert h["loss"] == pytest.approx(h["train_loss"], rel=1e-5)
    w = model.getModel().fc.weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)


def test_logged_metrics_are_returned(fitted):
    _, model, _ = fitted
    logged = model.getLoggedMetrics()
    assert {"train_loss", "val_loss"} <= set(logged)
    assert logged["val_loss"] == pytest.approx(model.getHistory()[-1]["val_loss"], rel=1e-5)


def test_both_ranks_end_with_identical_weights(fitted):
    _, model, out_dir = fitted
    rank0, rank1 = load_ranks(out_dir)
    assert rank0["state"].keys() == rank1["state"].keys()
    for key, value in rank0["state"].items():
        assert torch.equal(value, rank1["state"][key]), key
        assert torch.equal(value, model.getModel().state_dict()[key]), key


def test_batches_are_dicts_of_column_tensors_equal_per_rank(fitted):
    _, _, out_dir = fitted
    ranks = load_ranks(out_dir)
    for r in ranks:
        assert r["first_batch"] == {
            "features": ([BATCH, N_FEATURES], "torch.float32"),
            "y": ([BATCH], "torch.float32"),
        }
    counts = [r["batches"] for r in ranks]
    assert counts[0] == counts[1]
    assert sorted(counts[0]) == [0, 1, 2, 3]
    assert len(set(counts[0].values())) == 1 and counts[0][0] >= 5


def test_transform_equals_module_applied_locally(fitted, df):
    _, model, _ = fitted
    out = model.transform(df).select("features", "y__output").collect()
    x = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    got = np.array([r["y__output"] for r in out])
    with torch.no_grad():
        want = model.getModel()(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_checkpoint_and_logs_are_in_the_store(fitted, store):
    _, model, _ = fitted
    ckpt_dir = store.get_checkpoint_path("fit_main")
    assert {"last_epoch.ckpt", "checkpoint.json"} <= set(store.listdir(ckpt_dir))
    ckpt = torch.load(os.path.join(ckpt_dir, "last_epoch.ckpt"), weights_only=False)
    assert ckpt["epoch"] == 3
    for key, value in model.getModel().state_dict().items():
        assert torch.equal(ckpt["state_dict"][key], value), key
    logs = store.listdir(store.get_logs_path("fit_main"))
    assert any(name.startswith("events.out.tfevents") for name in logs), logs


def test_hot_start_resumes_from_the_saved_epoch(df, store, tmp_path):
    first = make_estimator(store, epochs=2, run_id="hot").fit(df)
    ckpt_path = os.path.join(store.get_checkpoint_path("hot"), "last_epoch.ckpt")
    steps_after_two = torch.load(ckpt_path, weights_only=False)["global_step"]
    # A differently initialised module: resuming must replace its weights with the checkpoint's.
    torch.manual_seed(123)
    fresh = LinearModule()
    out_dir = str(tmp_path)
    est = make_estimator(store, fresh, epochs=3, run_id="hot", callbacks=[RankRecorder(out_dir)])
    second = est.fit(df)
    history = second.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert history[:2] == first.getHistory()
    # Only epoch 2 ran, on both ranks, continuing from the saved weights and optimizer step.
    assert [sorted(r["batches"]) for r in load_ranks(out_dir)] == [[2], [2]]
    assert torch.load(ckpt_path, weights_only=False)["global_step"] == steps_after_two * 3 // 2
    assert history[2]["loss"] < history[1]["loss"] < 0.5 * history[0]["loss"]


def test_elastic_fit_relaunches_from_the_last_checkpoint(df, store, tmp_path, caplog):
    clock, epochs_log = tmp_path / "clock", tmp_path / "epochs"
    killer = KillOnceMidEpoch(2, str(clock), str(epochs_log))
    est = make_estimator(store, run_id="elastic", callbacks=[killer], elastic=True)
    with caplog.at_level("WARNING", logger="spark_estimators.core.estimator"):
        model = est.fit(df)
    assert clock.exists(), "rank 1 was never killed"
    # Epochs 0 and 1 came from the checkpoint; only the cut epoch 2 was trained again.
    assert [int(e) for e in epochs_log.read_text().split()] == [0, 1, 2, 2, 3]
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[3]["loss"] < 0.5 * history[0]["loss"]
    relaunches = [r.getMessage() for r in caplog.records if "relaunching" in r.getMessage()]
    assert len(relaunches) == 1 and "rank 1" in relaunches[0] and "SIGKILL" in relaunches[0]


def test_early_stopping_stops_all_ranks_together(df, store, tmp_path):
    out_dir = str(tmp_path)
    stopper = EarlyStopping(monitor="divergent", patience=1, check_on_train_epoch_end=True)
    model = make_estimator(
        store,
        RankDivergentModule(),
        epochs=5,
        callbacks=[stopper, RankRecorder(out_dir)],
        backward_passes_per_step=2,
    ).fit(df)
    # Rank 1's metric stops improving at epoch 1; rank 0's keeps improving. Both stop.
    assert [h["epoch"] for h in model.getHistory()] == [0, 1]
    # No validation data: the module's validation_step was skipped.
    assert "val_loss" not in model.getHistory()[-1]
    # With gradient accumulation (accumulate_grad_batches=2) "loss" is still the step loss.
    for h in model.getHistory():
        assert h["loss"] == pytest.approx(h["train_loss"], rel=1e-5)
    assert [sorted(r["batches"]) for r in load_ranks(out_dir)] == [[0, 1], [0, 1]]


def test_terminate_on_nan_fails_the_fit_with_a_clear_error(df, store):
    est = make_estimator(store, NaNAtEpochOne(), epochs=3, terminate_on_nan=True)
    with pytest.raises(TrainingFailedError, match=r"loss is nan at epoch 1.*terminate_on_nan"):
        est.fit(df)


def test_save_load_round_trip(fitted, df, tmp_path):
    est, model, _ = fitted
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = LightningModel.load(path)
    assert loaded.getHistory() == model.getHistory()
    assert loaded.getLoggedMetrics() == model.getLoggedMetrics()
    a = [r["y__output"] for r in model.transform(df).orderBy("x0").collect()]
    b = [r["y__output"] for r in loaded.transform(df).orderBy("x0").collect()]
    assert a == b
    pm = PipelineModel(stages=[model])
    pm.write().overwrite().save(str(tmp_path / "pm"))
    assert isinstance(PipelineModel.load(str(tmp_path / "pm")).stages[0], LightningModel)
    # An unfitted estimator inside a Pipeline saves without its store.
    Pipeline(stages=[est]).write().overwrite().save(str(tmp_path / "pipe"))
    est2 = Pipeline.load(str(tmp_path / "pipe")).getStages()[0]
    assert isinstance(est2, LightningEstimator)
    assert est2.getStore() is None
    assert est2.getLogEveryNSteps() == 1 and est2.getEpochs() == 4
    assert isinstance(est2.getModel(), LinearModule)


def test_horovod_names_are_aliases():
    assert TorchEstimator is LightningEstimator
    assert TorchModel is LightningModel


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"model": torch.nn.Linear(4, 1)}, "LightningModule.*use spark_estimators.torch"),
        (
            {"optimizer": torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)},
            r"optimizer= \(a SGD\) is not used.*configure_optimizers",
        ),
        ({"loss": torch.nn.MSELoss()}, r"loss= \(a MSELoss\).*training_step"),
        ({"scale_lr": True}, r"scale_lr=True.*self.trainer.world_size"),
        ({"trainer_args": {"strategy": "fsdp"}}, r"trainer_args\['strategy'\]='fsdp' is not"),
        ({"trainer_args": {"max_epochs": 3}}, r"trainer_args\['max_epochs'\].*use epochs"),
        ({"trainer_args": {"gradient_clip": 1.0}}, "Did you mean gradient_clip_val"),
        ({"trainer_args": [1]}, "expected a dict"),
        ({"num_gpus": 2}, "num_gpus=2 is invalid"),
        ({"collective_backend": "mpi"}, "collective_backend='mpi' is invalid"),
        ({"callbacks": [object()]}, "pytorch_lightning.Callback"),
        ({"profiler": "fancy"}, "profiler='fancy' is invalid"),
        ({"logger": "tb"}, "logger='tb' is invalid"),
        ({"label_shapes": [[1], [2]]}, "label_shapes has 2 entries"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0 is invalid"),
    ],
)
def test_bad_input_fails_in_driver(df, store, kwargs, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        make_estimator(store, **kwargs).fit(df)


class ImageModule(pl.LightningModule):
    """Needs [batch, 1, 4, 4] inputs: a 5-D batch (issue 19) fails its assertion."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, kernel_size=2)
        self.fc = torch.nn.Linear(9, 1)

    def forward(self, x):
        assert x.dim() == 4 and tuple(x.shape[1:]) == (1, 4, 4), tuple(x.shape)
        return self.fc(self.conv(x).flatten(1))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["image"]).squeeze(1), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_horovod_full_input_shape_trains_and_transforms_on_the_same_4d_tensors(spark, store):
    rng = np.random.default_rng(4)
    images = rng.normal(size=(128, 16))
    rows = [(images[i].tolist(), float(images[i].sum())) for i in range(128)]
    df = spark.createDataFrame(rows, ["image", "y"])
    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=2,
        store=store,
        model=ImageModule(),
        feature_cols=["image"],
        label_cols=["y"],
        input_shapes=[[-1, 1, 4, 4]],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    model = est.fit(df)
    assert len(model.getHistory()) == 1
    out = model.transform(df).limit(8).collect()
    x = torch.tensor([r["image"] for r in out], dtype=torch.float32).reshape(-1, 1, 4, 4)
    with torch.no_grad():
        want = model.getModel()(x).numpy().ravel()
    np.testing.assert_allclose([r["y__output"] for r in out], want, rtol=1e-5, atol=1e-6)
