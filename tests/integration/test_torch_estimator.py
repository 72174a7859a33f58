"""TorchEstimator end to end on real Spark with 2 processes and small data."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.backend import SparkBackend  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import EarlyStopping, TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


class Linear(torch.nn.Module):
    def __init__(self, n_in=N_FEATURES, n_out=1):
        super().__init__()
        self.fc = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.fc(x)


class TwoInTwoOut(torch.nn.Module):
    """Two feature inputs (a vector and a scalar) and two outputs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(N_FEATURES + 1, 1)
        self.b = torch.nn.Linear(N_FEATURES + 1, 2)

    def forward(self, vec, scalar):
        x = torch.cat([vec, scalar], dim=1)
        return self.a(x), self.b(x)


def make_df(spark, n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), float(x[i, 0])) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y", "x0"])


def make_estimator(store_, **kw):
    torch.manual_seed(0)
    model = Linear()
    opts = dict(
        num_proc=2,
        store=store_,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("torch-store")))


@pytest.fixture(scope="module")
def df(spark):
    return make_df(spark).cache()


@pytest.fixture(scope="module")
def fitted(df, store):
    est = make_estimator(store, validation=0.25, metrics=[mae], run_id="fit_main")
    return est, est.fit(df)


def mae(output, label):
    return torch.mean(torch.abs(output - label))


def test_loss_decreases_below_bound_with_validation_history(fitted):
    _, model = fitted
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.05 < history[0]["loss"]
    assert history[-1]["val_loss"] < 0.05
    assert "mae" in history[-1] and "val_mae" in history[-1]
    assert history[-1]["mae"] < history[0]["mae"]
    w = model.getModel().fc.weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)


def test_transform_equals_plain_torch(fitted, df):
    _, model = fitted
    out = model.transform(df).select("features", "y__output").collect()
    x = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    got = np.array([r["y__output"] for r in out])
    with torch.no_grad():
        want = model.getModel()(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_checkpoints_and_logs_written_per_run(fitted, store):
    _, model = fitted
    assert model.getRunId() == "fit_main"
    ckpt_dir = store.get_checkpoint_path("fit_main")
    assert "checkpoint.pt" in store.listdir(ckpt_dir)
    assert "fit_main" in store.list_runs()


def test_hot_start_trains_exactly_the_missing_epochs(df, store):
    first = make_estimator(store, epochs=2, run_id="hot").fit(df)
    assert [h["epoch"] for h in first.getHistory()] == [0, 1]
    second = make_estimator(store, epochs=3, run_id="hot").fit(df)
    assert [h["epoch"] for h in second.getHistory()] == [0, 1, 2]
    # The first two epochs are the saved ones, not retrained.
    assert second.getHistory()[:2] == first.getHistory()


def _saved_lr_and_size(store, run_id):
    state = torch.load(
        io.BytesIO(store.read_bytes(store.get_checkpoint_path(run_id) + "/checkpoint.pt")),
        weights_only=False,
    )
    return state["optimizer"]["param_groups"][0]["lr"], state["size"]


def test_hot_start_on_fewer_ranks_rescales_the_learning_rate(df, store):
    # scale_lr (the default): the rate is 0.05 x ranks. The checkpoint of a 2-rank run holds
    # 0.1; a hot start on 1 rank (as after an elastic relaunch with fewer) must train at 0.05.
    make_estimator(store, epochs=1, run_id="torch_resize").fit(df)
    assert _saved_lr_and_size(store, "torch_resize") == (pytest.approx(0.1), 2)
    resumed = make_estimator(store, epochs=2, run_id="torch_resize", num_proc=1).fit(df)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1]
    assert _saved_lr_and_size(store, "torch_resize") == (pytest.approx(0.05), 1)


def test_pipeline_save_load_round_trip(fitted, df, tmp_path):
    est, model = fitted
    pm = PipelineModel(stages=[model])
    path = str(tmp_path / "pm")
    pm.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[0], TorchModel)
    a = [r["y__output"] for r in pm.transform(df).orderBy("x0").collect()]
    b = [r["y__output"] for r in loaded.transform(df).orderBy("x0").collect()]
    assert a == b
    assert loaded.stages[0].getHistory() == model.getHistory()
    # An unfitted estimator inside a Pipeline saves without its store.
    pipe = Pipeline(stages=[est])
    pipe.write().overwrite().save(str(tmp_path / "pipe"))
    est2 = Pipeline.load(str(tmp_path / "pipe")).getStages()[0]
    assert isinstance(est2, TorchEstimator)
    assert est2.getStore() is None
    assert est2.getFeatureCols() == ["features"] and est2.getEpochs() == 4


def test_multi_input_multi_output_and_output_cols(spark, store):
    rng = np.random.default_rng(3)
    n = 256
    x = rng.normal(size=(n, N_FEATURES))
    s = rng.normal(size=n)
    y1 = x @ TRUE_W + s
    y2 = np.stack([x[:, 0] - s, x[:, 1] * 2], axis=1)
    rows = [
        (Vectors.dense(x[i].tolist()), float(s[i]), float(y1[i]), y2[i].tolist()) for i in range(n)
    ]
    df = spark.createDataFrame(rows, ["vec", "s", "y1", "y2"])
    torch.manual_seed(0)
    net = TwoInTwoOut()
    est = TorchEstimator(
        num_proc=2,
        store=store,
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        loss=[torch.nn.MSELoss(), torch.nn.MSELoss()],
        loss_weights=[1.0, 0.5],
        feature_cols=["vec", "s"],
        label_cols=["y1", "y2"],
        batch_size=16,
        epochs=6,
        output_cols=["p1", "p2"],
        verbose=0,
    )
    model = est.fit(df)
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.2 * hist[0]["loss"]
    out = model.transform(df).select("vec", "s", "p1", "p2").limit(20).collect()
    assert all(isinstance(r["p1"], float) for r in out)
    assert all(len(r["p2"]) == 2 for r in out)
    vec = torch.tensor(np.array([r["vec"].toArray() for r in out]), dtype=torch.float32)
    sc = torch.tensor([[r["s"]] for r in out], dtype=torch.float32)
    with torch.no_grad():
        w1, w2 = model.getModel()(vec, sc)
    np.testing.assert_allclose([r["p1"] for r in out], w1.numpy().ravel(), atol=1e-5)
    np.testing.assert_allclose([r["p2"] for r in out], w2.numpy(), atol=1e-5)


def test_sample_weights_change_the_fit(spark, store):
    # Two groups disagree on y; weights decide which one the constant model follows.
    rows = [(Vectors.dense([1.0]), 0.0, 1.0) for _ in range(64)]
    rows += [(Vectors.dense([1.0]), 10.0, 9.0) for _ in range(64)]
    df = spark.createDataFrame(rows, ["features", "y", "w"])

    def fit(weight_col, lr):
        torch.manual_seed(0)
        m = Linear(1)
        est = TorchEstimator(
            num_proc=2,
            store=store,
            model=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=lr),
            loss=torch.nn.MSELoss(reduction="none"),
            feature_cols=["features"],
            label_cols=["y"],
            sample_weight_col=weight_col,
            batch_size=16,
            epochs=8,
            verbose=0,
            scale_lr=False,
        )
        fitted = est.fit(df)
        with torch.no_grad():
            return float(fitted.getModel()(torch.tensor([[1.0]])))

    # Horovod's weighted loss is mean(w * loss) (weights mean 5 here): a smaller rate keeps SGD
    # stable; the fixed point is still the weighted mean.
    unweighted, weighted = fit(None, 0.1), fit("w", 0.02)
    assert abs(unweighted - 5.0) < 0.6  # mean of 0 and 10
    assert abs(weighted - 9.0) < 0.6  # (0*1 + 10*9) / 10


class RecordingBackend(SparkBackend):
    """The default backend, keeping what every rank returned (``backend=`` is public API)."""

    results: list | None = None

    def run(self, fn, args=(), kwargs=None, env=None, event_callback=None):
        self.results = super().run(fn, args, kwargs, env, event_callback)
        return self.results


def _weights_sha256(module):
    """The parameters' fingerprint (buffers such as BatchNorm statistics may differ per rank)."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters(), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_both_ranks_end_with_the_weights_of_the_returned_model(df, store):
    backend = RecordingBackend(num_proc=2, verbose=0)
    model = make_estimator(store, epochs=2, run_id="same_weights", backend=backend).fit(df)
    results = backend.results
    assert [r["rank"] for r in results] == [0, 1]
    fingerprints = [r["fingerprint"] for r in results]
    assert fingerprints[0] == fingerprints[1]
    assert fingerprints[0] == _weights_sha256(model.getModel())
    # Training moved the weights away from the (seeded) initial ones.
    torch.manual_seed(0)
    assert fingerprints[0] != _weights_sha256(Linear())


def test_diverged_ranks_fail_the_fit():
    from spark_estimators.core.checks import check_fingerprints
    from spark_estimators.errors import TrainingFailedError

    same = [{"fingerprint": "a"}, {"fingerprint": "a"}]
    assert check_fingerprints(same) == ["a", "a"]
    with pytest.raises(TrainingFailedError, match="ranks ended with different weights"):
        check_fingerprints([{"fingerprint": "a"}, {"fingerprint": "b"}])


def test_early_stopping_stops_all_ranks(df, store):
    stopper = EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    model = make_estimator(store, epochs=5, callbacks=[stopper]).fit(df)
    # min_delta is huge: epoch 1 never "improves", so training stops after epoch 1 on every rank.
    assert [h["epoch"] for h in model.getHistory()] == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"feature_cols": ["nope"]}, r"column\(s\) \['nope'\] not found.*available columns"),
        ({"label_cols": []}, "label_cols=.* non-empty list"),
        ({"batch_size": 0}, "batch_size=0 is invalid"),
        ({"validation": 1.5}, r"validation=1.5 is invalid.*\[0, 1\)"),
        ({"model": "not a model"}, "model must be a torch.nn.Module"),
        ({"loss": None}, "loss is required"),
        ({"reader": "csv"}, "reader='csv' is invalid"),
        ({"loss_weights": [1.0, 2.0]}, "loss_weights has 2 entries"),
        ({"loss_weights": {"y": 1.0}}, r"loss_weights=\{'y': 1.0\} is a dict.*give a list"),
        ({"store": "/tmp/x"}, "store='/tmp/x' is invalid.*Store.create"),
        ({"collective_backend": "tcp"}, "collective_backend='tcp' is invalid"),
        ({"elastic": True, "reset_limit": -1}, "reset_limit=-1 is invalid.*>= 0"),
        ({"min_num_proc": 1}, "min_num_proc=1 is invalid.*unless elastic=True"),
        ({"elastic": True, "min_num_proc": 3}, "min_num_proc=3 is larger than num_proc=2"),
        ({"elastic": True, "min_num_proc": 0}, "min_num_proc=0 is invalid"),
        (
            {"optimizer": torch.optim.SGD(Linear().parameters(), lr=0.1)},
            "optimizer holds parameters that are not the model's",
        ),
    ],
)
def test_bad_input_fails_in_driver(df, store, kwargs, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        make_estimator(store, **kwargs).fit(df)


def test_unknown_keyword_suggests_the_right_one(store):
    with pytest.raises(ConfigurationError, match="unknown keyword 'batchsize'.*batch_size"):
        make_estimator(store, batchsize=3)


def test_ported_horovod_mnist_example_runs(spark):
    """horovod.spark's TorchEstimator MNIST example with only its imports changed."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "examples" / "torch_horovod_mnist.py"
    spec = importlib.util.spec_from_file_location("torch_horovod_mnist", path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["torch_horovod_mnist"] = module
    spec.loader.exec_module(module)
    accuracy, torch_model = module.main(spark)
    assert accuracy > 0.9
    assert torch_model.getOutputCols() == ["label_prob"]
    assert len(torch_model.getHistory()) == 4
