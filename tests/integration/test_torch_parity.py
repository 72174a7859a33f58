"""Horovod TorchEstimator parity: train_minibatch_fn, sample weights, TorchScript (issue 21)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

TRUE_W = np.array([1.5, -2.0])


class Linear(torch.nn.Module):
    def __init__(self, n_in: int = 2):
        super().__init__()
        self.fc = torch.nn.Linear(n_in, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("torch-parity-store")))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(7)
    n = 256
    x = rng.normal(size=(n, 2))
    y = x @ TRUE_W + 0.5
    w = np.where(np.arange(n) % 2 == 0, 1.0, 9.0)  # mean 5: Horovod's formula != weighted mean
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), float(w[i])) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y", "w"]).cache()


def estimator(store_, model, lr=0.05, **kw):
    opts = dict(
        num_proc=2,
        store=store_,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=3,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def horovod_style_minibatch_fn(log_dir):
    """Horovod's documented default ``train_minibatch`` body, plus a record of each call."""

    def train_minibatch(
        model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights
    ):
        with open(os.path.join(log_dir, f"calls-{os.getpid()}"), "a") as f:
            f.write("1\n")
        optimizer.zero_grad()
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        optimizer.step()
        return outputs, loss

    return train_minibatch


def test_horovod_style_train_minibatch_fn_trains_every_step(df, store, tmp_path):
    torch.manual_seed(0)
    fn = horovod_style_minibatch_fn(str(tmp_path))
    model = estimator(
        store, Linear(), train_minibatch_fn=fn, train_steps_per_epoch=3, epochs=4
    ).fit(df)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.1 * history[0]["loss"]
    # The user's fn ran every training step on both ranks (3 steps x 4 epochs each).
    counts = sorted(len(open(tmp_path / name).readlines()) for name in os.listdir(tmp_path))
    assert counts == [12, 12]


def test_train_minibatch_fn_with_accumulation_is_rejected(store):
    torch.manual_seed(0)
    est = estimator(store, Linear(), train_minibatch_fn=lambda *a: None, backward_passes_per_step=2)
    with pytest.raises(ConfigurationError, match="backward_passes_per_step=2 cannot be combined"):
        est._validate_params(None)


def _reference_weighted_steps(model, df, lr, steps, loss_of):
    """Full-batch SGD on one process with Horovod's weighted loss, computed here by hand."""
    rows = df.collect()
    x = torch.tensor([r["features"].toArray() for r in rows], dtype=torch.float32)
    y = torch.tensor([[r["y"]] for r in rows], dtype=torch.float32)
    w = torch.tensor([r["w"] for r in rows], dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        per_row = loss_of(model(x), y).reshape(-1)
        loss = (per_row * w).mean()  # horovod: mean(loss_row * weight_row), not a weighted mean
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


@pytest.mark.parametrize("loss", [F.mse_loss, torch.nn.MSELoss()], ids=["functional", "module"])
def test_sample_weights_follow_horovods_formula(df, store, loss):
    torch.manual_seed(3)
    start = Linear()
    reference = copy.deepcopy(start)
    fitted = estimator(
        store,
        start,
        loss=loss,
        sample_weight_col="w",
        num_proc=1,
        batch_size=256,
        train_steps_per_epoch=1,
        epochs=3,
        shuffle=False,
        scale_lr=False,
    ).fit(df)
    want_losses = _reference_weighted_steps(
        reference, df, 0.05, 3, lambda out, lab: (out - lab) ** 2
    )
    np.testing.assert_allclose([h["loss"] for h in fitted.getHistory()], want_losses, rtol=1e-4)
    got = fitted.getModel().state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)


def test_torchscript_model_trains_transforms_and_saves(df, store, tmp_path):
    torch.manual_seed(0)
    scripted = torch.jit.script(Linear())
    fitted = estimator(store, scripted, epochs=6, lr=0.1).fit(df)
    net = fitted.getModel()
    assert isinstance(net, torch.jit.ScriptModule)
    assert fitted.getHistory()[-1]["loss"] < 0.01
    np.testing.assert_allclose(net.fc.weight.detach().numpy().ravel(), TRUE_W, atol=0.05)
    rows = fitted.transform(df).select("features", "y__output").limit(16).collect()
    x = torch.tensor(np.array([r["features"].toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        want = net(x).numpy().ravel()
    np.testing.assert_allclose([r["y__output"] for r in rows], want, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "scripted_model")
    fitted.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert isinstance(loaded.getModel(), torch.jit.ScriptModule)
    with torch.no_grad():
        np.testing.assert_allclose(loaded.getModel()(x).numpy().ravel(), want, rtol=1e-6)


def test_shuffle_buffer_size_zero_turns_shuffling_off(df, store):
    def weights(**kw):
        torch.manual_seed(0)
        fitted = estimator(store, Linear(), epochs=1, **kw).fit(df)
        return fitted.getModel().fc.weight.detach().numpy().copy()

    unshuffled = weights(shuffle=False)
    np.testing.assert_array_equal(weights(shuffle_buffer_size=0), unshuffled)
    # The default shuffles (same seed), so its batches, and so its weights, differ.
    assert not np.array_equal(weights(), unshuffled)


class TwoOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 1)
        self.b = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x), self.b(x)


def width(output, label):
    return torch.tensor(float(output.shape[1]))


def label_width(output, label):
    return torch.tensor(float(label.shape[1]))


def tens(output, label):
    return torch.tensor(10.0 * output.shape[1])


def hundreds(output, label):
    return torch.tensor(100.0 * output.shape[1])


def test_horovod_metric_groups_are_applied_per_output(spark, store):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 2))
    rows = [(Vectors.dense(r.tolist()), float(r[0]), [float(r[1]), float(-r[1])]) for r in x]
    df = spark.createDataFrame(rows, ["features", "y1", "y2"])
    torch.manual_seed(0)
    net = TwoOut()
    fitted = estimator(
        store,
        net,
        loss=torch.nn.MSELoss(),
        label_cols=["y1", "y2"],
        # a function: every output; a group of one: every output; a group of two: one each
        metrics=[width, [label_width], [tens, hundreds]],
        epochs=1,
    ).fit(df)
    (logs,) = fitted.getHistory()
    got = {k: v for k, v in logs.items() if k not in ("epoch", "loss")}
    assert got == {
        "width_y1": 1.0,
        "width_y2": 2.0,
        "label_width_y1": 1.0,
        "label_width_y2": 2.0,
        "tens_y1": 10.0,
        "hundreds_y2": 200.0,
    }


def test_a_metric_group_of_the_wrong_length_is_refused(store):
    est = estimator(store, TwoOut(), label_cols=["y1", "y2"], metrics=[[width, width, width]])
    with pytest.raises(ConfigurationError, match=r"metrics entry .* is invalid.*list of one"):
        est._validate_params(None)


def test_horovod_model_accessors_and_loss_conflict(df, store):
    torch.manual_seed(0)
    fitted = estimator(store, Linear(), epochs=1).fit(df)
    # horovod's TorchModel names its prediction columns even when none were set
    assert fitted.getOutputCols() == ["y__output"]
    assert fitted.getFeatureColumns() == ["features"] and fitted.getLabelColumns() == ["y"]
    assert "y__output" in fitted.transform(df).columns
    both = estimator(store, Linear(), loss_constructors=[torch.nn.MSELoss])
    with pytest.raises(ConfigurationError, match="loss and loss_constructors were both given"):
        both._validate_params(None)
