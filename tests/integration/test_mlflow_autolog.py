"""Fits under MLflow autologging (issue 41): one coherent run, our params/metrics/model once.

Databricks turns ``mlflow.autolog()`` on by default; before issue 41 every fit under it failed
with MLflow's "Changing param values is not allowed" (autologging had logged each Param by its
``str`` first). Each test asserts the run's contents against the fit's own history, against a
real local MLflow file store.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
torch = pytest.importorskip("torch")
mlflow = pytest.importorskip("mlflow")

from pyspark.ml import Pipeline  # noqa: E402
from pyspark.ml.feature import VectorAssembler  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.tracking import RUN_ID_TAG  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

EPOCHS = 2
EXPERIMENT = "spark_estimators_autolog"


def _autolog_off():
    mlflow.autolog(disable=True)
    for flavor in ("pyspark.ml", "pytorch", "keras", "tensorflow"):
        module = __import__(f"mlflow.{flavor}", fromlist=["autolog"])
        module.autolog(disable=True)


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    """A fresh local tracking store; every autologging integration off again afterwards."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(EXPERIMENT)
    try:
        yield mlflow.tracking.MlflowClient(uri)
    finally:
        _autolog_off()
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)


def runs(client):
    experiment = mlflow.get_experiment_by_name(EXPERIMENT).experiment_id
    return client.search_runs([experiment])


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(128, 2))
    rows = [(Vectors.dense(r.tolist()), float(r @ [2.0, -1.0] + 0.3)) for r in x]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


def torch_estimator(tmp_path, **kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opts = dict(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=EPOCHS,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def assert_one_coherent_run(client, run, fitted, params):
    """``run`` holds ``params`` with our values, each epoch's metrics once, one model."""
    assert run.info.status == "FINISHED"
    data = client.get_run(run.info.run_id).data
    for key, value in params.items():
        assert data.params[key] == value, (key, data.params.get(key))
    # Nothing of autologging's Param dump: it logged the store, and the module's repr as model.
    assert "store" not in data.params and "estimator_class" not in data.tags
    assert data.tags[RUN_ID_TAG] == fitted.getRunId()
    history = fitted.getHistory()
    assert len(history) == EPOCHS
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in losses) == [(h["epoch"], h["loss"]) for h in history]
    models = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
    )
    assert len(models) == 1
    return models[0]


def test_torch_fit_under_mlflow_autolog_is_one_run_with_our_values(tracking, df, tmp_path):
    mlflow.autolog()
    fitted = torch_estimator(tmp_path, run_id="auto_torch").fit(df)
    (run,) = runs(tracking)  # one run, not autologging's and ours
    assert run.info.run_name == "auto_torch"
    logged = assert_one_coherent_run(
        tracking,
        run,
        fitted,
        {"model": "Linear", "loss": "MSELoss", "optimizer": "SGD", "epochs": str(EPOCHS)},
    )
    loaded = mlflow.pytorch.load_model(logged.model_uri)
    x = torch.tensor([[0.5, -1.0]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), fitted.getModel()(x).numpy(), rtol=1e-6)
    assert mlflow.active_run() is None  # the fit ended the run it started


def test_pyspark_ml_autolog_inside_a_users_run_logs_into_that_run(tracking, df, tmp_path):
    mlflow.pyspark.ml.autolog()
    with mlflow.start_run(run_name="mine") as mine:
        fitted = torch_estimator(tmp_path, run_id="in_users_run").fit(df)
        assert mlflow.active_run().info.run_id == mine.info.run_id
    (run,) = runs(tracking)
    assert run.info.run_id == mine.info.run_id
    assert_one_coherent_run(tracking, run, fitted, {"loss": "MSELoss", "batchSize": "32"})


def test_log_to_mlflow_false_logs_nothing_even_under_autologging(tracking, df, tmp_path):
    mlflow.autolog()
    fitted = torch_estimator(tmp_path, log_to_mlflow=False).fit(df)
    assert len(fitted.getHistory()) == EPOCHS
    assert runs(tracking) == []


def test_a_pipeline_under_autolog_gets_its_run_and_the_fit_a_nested_run(spark, tracking, tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(96, 2))
    raw = spark.createDataFrame(
        [(float(a), float(b), float(2 * a - b)) for a, b in x], ["a", "b", "y"]
    )
    mlflow.pyspark.ml.autolog()
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=["a", "b"], outputCol="features"),
            torch_estimator(tmp_path, run_id="in_pipeline"),
        ]
    )
    fitted = pipeline.fit(raw).stages[-1]
    by_name = {r.info.run_name: r for r in runs(tracking)}
    assert set(by_name) - {"in_pipeline"}, by_name  # autologging's run of the Pipeline
    child = by_name.pop("in_pipeline")
    (parent,) = by_name.values()
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert_one_coherent_run(tracking, child, fitted, {"epochs": str(EPOCHS), "model": "Linear"})


def test_lightning_fit_under_autologgers(tracking, df, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    import torch.nn.functional as F

    from spark_estimators.lightning import LightningEstimator

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.fc(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_mse", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    mlflow.autolog()
    mlflow.pytorch.autolog()  # Lightning's autologger on too (what Databricks turns on)
    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=Regressor(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=EPOCHS,
        verbose=0,
        run_id="auto_lightning",
    )
    fitted = est.fit(df)
    (run,) = runs(tracking)
    assert run.info.run_name == "auto_lightning" and run.info.status == "FINISHED"
    assert run.data.params["model"] == "Regressor"
    mse = tracking.get_metric_history(run.info.run_id, "train_mse")
    assert sorted((m.step, m.value) for m in mse) == [
        (h["epoch"], h["train_mse"]) for h in fitted.getHistory()
    ]
    assert len(mse) == EPOCHS
    (logged,) = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
    )
    assert logged.name == "model"


def test_keras_fit_under_autologgers(tracking, df, tmp_path):
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    import mlflow.keras

    from spark_estimators.keras import KerasEstimator

    mlflow.autolog()
    mlflow.keras.autolog()
    mlflow.tensorflow.autolog()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    est = KerasEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=EPOCHS,
        verbose=0,
        run_id="auto_keras",
    )
    fitted = est.fit(df)
    (run,) = runs(tracking)
    assert run.info.run_name == "auto_keras"
    logged = assert_one_coherent_run(
        tracking, run, fitted, {"model": "Sequential", "loss": "mse", "optimizer": "SGD"}
    )
    loaded = mlflow.keras.load_model(logged.model_uri)
    x = np.array([[0.5, -1.0]], dtype=np.float32)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), fitted.getModel().predict(x, verbose=0), rtol=1e-6
    )
