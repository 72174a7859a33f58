"""MLflow tracking of a TorchEstimator fit against a real local MLflow file store (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mlflow = pytest.importorskip("mlflow")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.tracking import RUN_ID_TAG, MlflowTracker  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    """A fresh local tracking store (MLflow 3 needs an opt-in for the file backend)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("spark_estimators_test")
    yield mlflow.tracking.MlflowClient(uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(256, 2))
    rows = [(Vectors.dense(r.tolist()), float(r @ [2.0, -1.0] + 0.3)) for r in x]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


def mae(output, label):
    return torch.mean(torch.abs(output - label))


def estimator(tmp_path, **kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opts = dict(epochs=3)
    opts.update(kw)
    return TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        metrics=[mae, lambda out, lab: torch.mean((out - lab) ** 2)],
        feature_cols=["features"],
        label_cols=["y"],
        validation=0.25,
        batch_size=32,
        verbose=0,
        **opts,
    )


def test_active_run_gets_params_epoch_metrics_and_the_model_with_signature(tracking, df, tmp_path):
    with mlflow.start_run() as run:
        fitted = estimator(tmp_path, run_id="tracked").fit(df)
    history = fitted.getHistory()
    data = tracking.get_run(run.info.run_id).data
    assert data.params["epochs"] == "3" and data.params["batchSize"] == "32"
    assert data.params["model"] == "Linear" and data.params["optimizer"] == "SGD"
    assert data.tags[RUN_ID_TAG] == "tracked"
    for key in ("loss", "val_loss", "mae", "val_mae", "<lambda>"):
        logged = tracking.get_metric_history(
            run.info.run_id, key.replace("<", "_").replace(">", "_")
        )
        # One point per step (issue 27: log_model at step 0 copied step 0's metrics again).
        points = sorted((m.step, m.value) for m in logged)
        assert points == [(h["epoch"], h[key]) for h in history], key
    # The user's run is theirs: the fit leaves it as it was (finished by the `with`).
    assert tracking.get_run(run.info.run_id).info.status == "FINISHED"

    (logged_model,) = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
    )
    # The logged model carries the final epoch's metrics (issue 27: it carried epoch 0's).
    final = history[-1]
    carried = {m.key: (m.step, m.value) for m in logged_model.metrics}
    assert carried == {
        "loss": (final["epoch"], final["loss"]),
        "val_loss": (final["epoch"], final["val_loss"]),
        "mae": (final["epoch"], final["mae"]),
        "val_mae": (final["epoch"], final["val_mae"]),
        "_lambda_": (final["epoch"], final["<lambda>"]),
        "val__lambda_": (final["epoch"], final["val_<lambda>"]),
    }
    info = mlflow.models.get_model_info(logged_model.model_uri)
    assert [s.shape for s in info.signature.inputs.inputs] == [(-1, 2)]
    assert [s.shape for s in info.signature.outputs.inputs] == [(-1, 1)]
    loaded = mlflow.pytorch.load_model(logged_model.model_uri)
    x = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), fitted.getModel()(x).numpy(), rtol=1e-6)


def test_log_to_mlflow_true_starts_and_finishes_a_run_named_after_the_fit(tracking, df, tmp_path):
    assert mlflow.active_run() is None
    fitted = estimator(tmp_path, run_id="own_run", log_to_mlflow=True, epochs=2).fit(df)
    assert mlflow.active_run() is None
    (run,) = tracking.search_runs(
        [mlflow.get_experiment_by_name("spark_estimators_test").experiment_id]
    )
    assert run.info.run_name == "own_run" and run.info.status == "FINISHED"
    losses = tracking.get_metric_history(run.info.run_id, "loss")
    assert {(m.step, m.value) for m in losses} == {
        (h["epoch"], h["loss"]) for h in fitted.getHistory()
    }


def test_nothing_is_logged_without_an_active_run_or_when_turned_off(tracking, tmp_path):
    assert MlflowTracker.for_fit(estimator(tmp_path), "quiet") is None
    with mlflow.start_run():
        assert MlflowTracker.for_fit(estimator(tmp_path, log_to_mlflow=False), "off") is None


def test_lightning_fit_logs_its_metrics_and_module(tracking, df, tmp_path):
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

    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=Regressor(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=2,
        verbose=0,
        log_to_mlflow=True,
        run_id="lightning_run",
    )
    fitted = est.fit(df)
    (run,) = tracking.search_runs(
        [mlflow.get_experiment_by_name("spark_estimators_test").experiment_id]
    )
    assert run.info.run_name == "lightning_run" and run.info.status == "FINISHED"
    mse = tracking.get_metric_history(run.info.run_id, "train_mse")
    assert {(m.step, m.value) for m in mse} == {
        (h["epoch"], h["train_mse"]) for h in fitted.getHistory()
    }
    (logged_model,) = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
    )
    loaded = mlflow.pytorch.load_model(logged_model.model_uri)
    x = torch.tensor([[1.0, 2.0]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), fitted.getModel()(x).numpy(), rtol=1e-6)


class EmbedThenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, idx):
        return self.out(self.emb(idx.squeeze(-1)))


def test_embedding_model_fed_an_indexed_column_is_logged_with_int64_inputs(
    spark, tracking, tmp_path
):
    # A StringIndexer-style double column feeding nn.Embedding: the logged example must be the
    # int64 indices training fed, else logging the model fails (it was a warning, no model).
    rows = [(float(i % 4), float(i % 4) * 0.5) for i in range(64)]
    data = spark.createDataFrame(rows, ["color_idx", "y"])
    torch.manual_seed(0)
    net = EmbedThenLinear()
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["color_idx"],
        label_cols=["y"],
        batch_size=8,
        epochs=2,
        verbose=0,
    )
    with mlflow.start_run() as run:
        fitted = est.fit(data)
    assert fitted.getIndexCols() == ["color_idx"]
    (logged_model,) = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
    )
    info = mlflow.models.get_model_info(logged_model.model_uri)
    assert [str(s.type) for s in info.signature.inputs.inputs] == ["int64"]
    loaded = mlflow.pytorch.load_model(logged_model.model_uri)
    idx = torch.tensor([[0], [3]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(idx).numpy(), fitted.getModel()(idx).numpy(), rtol=1e-6)
