"""``data="stream"``: TorchEstimator trains straight from the DataFrame, no Parquet copy.

Checked against the Parquet path on the same data: the same learned weights within a tolerance
(``scale_lr`` off, full-share batches so row order does not matter), equal steps per
rank whatever the partition sizes, validation (fraction and column), sample weights, no files
in the store's data directories, and the driver-side refusals.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(N_FEATURES, 1)

    def forward(self, x):
        return self.fc(x)


class StepCounter:
    """A callback that records the steps of each epoch on its rank (returned via history)."""

    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, step, logs):
        self.steps += 1

    def on_epoch_end(self, epoch, logs):
        logs["rank_steps"] = float(self.steps)
        self.steps = 0


def make_df(spark, n=600, seed=0, partitions=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [
        (Vectors.dense(x[i].tolist()), float(y[i]), float(1 + i % 3), i % 5 == 0) for i in range(n)
    ]
    return spark.createDataFrame(rows, ["features", "y", "w", "is_val"]).repartition(partitions)


def make_estimator(**kw):
    torch.manual_seed(0)
    model = Linear()
    opts = dict(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        random_seed=1,
        verbose=0,
        data="stream",
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def weights(model):
    fc = model.getModel().fc
    return np.concatenate([fc.weight.detach().numpy().ravel(), fc.bias.detach().numpy()])


def test_stream_learns_and_writes_no_parquet(spark, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    model = make_estimator(store=store, validation=0.2, epochs=4).fit(make_df(spark))
    history = model.getHistory()
    assert len(history) == 4
    assert history[-1]["loss"] < 0.05 * history[0]["loss"]
    assert history[-1]["val_loss"] < 0.05
    np.testing.assert_allclose(weights(model)[:N_FEATURES], TRUE_W, atol=0.1)
    # Checkpoints went to the store; no prepared data did.
    assert not any(f.endswith(".parquet") for _, _, fs in os.walk(tmp_path) for f in fs)
    assert os.listdir(tmp_path / "store")


def test_stream_matches_parquet_weights(spark, tmp_path):
    """Same data, same model: both paths learn the same weights and losses.

    Each rank's batch is its whole share (240 of 480 rows on either path), so the averaged
    gradient is the full-data gradient whatever order or partitioning each path gives the rows.
    """
    df = make_df(spark, n=480)
    common = dict(scale_lr=False, epochs=4, batch_size=240, validation=None)
    streamed = make_estimator(**common).fit(df)
    parquet = make_estimator(**common, data="parquet", store=LocalStore(str(tmp_path / "p"))).fit(
        df
    )
    np.testing.assert_allclose(weights(streamed), weights(parquet), atol=1e-5)
    np.testing.assert_allclose(
        [h["loss"] for h in streamed.getHistory()],
        [h["loss"] for h in parquet.getHistory()],
        rtol=1e-5,
    )


def test_equal_steps_with_unequal_partitions(spark):
    """Ranks agree on ceil(largest partition / batch) steps; each epoch the same count."""
    df = make_df(spark, n=203)  # round-robin shares 101/102 rows: 7 steps of 16 on both ranks
    model = make_estimator(callbacks=[StepCounter()], epochs=2).fit(df)
    steps = [h["rank_steps"] for h in model.getHistory()]
    assert steps == [7.0, 7.0]


def test_validation_column_and_sample_weights(spark):
    df = make_df(spark)
    model = make_estimator(validation="is_val", sample_weight_col="w", epochs=4).fit(df)
    history = model.getHistory()
    assert "val_loss" in history[-1] and history[-1]["val_loss"] < 0.05
    np.testing.assert_allclose(weights(model)[:N_FEATURES], TRUE_W, atol=0.1)


def test_stream_refuses_parquet_only_params_in_the_driver(spark):
    df = make_df(spark)
    with pytest.raises(ConfigurationError, match="partitions_per_process=4 has no effect"):
        make_estimator(partitions_per_process=4).fit(df)
    with pytest.raises(ConfigurationError, match="need a store"):
        make_estimator(run_id="r1").fit(df)
    with pytest.raises(ConfigurationError, match="data='bogus' is invalid"):
        make_estimator(data="bogus").fit(df)


class SpillProbe:
    """Records where this rank's spill lives while it trains; can fail the rank at an epoch."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def on_epoch_end(self, epoch, logs):
        from spark_estimators.data.stream_reader import rank_stream

        paths = [p for p, _ in rank_stream().segments("train")]
        logs["spill_files"] = float(sum(os.path.exists(p) for p in paths))
        logs["spill_dir"] = os.path.dirname(paths[0])
        if epoch == self.fail_at:
            raise RuntimeError("probe: this rank fails")


def _spills(spark):
    root = spark.conf.get("spark.local.dir")
    return [d for base, dirs, _ in os.walk(root) for d in dirs if d.startswith("se-stream-")]


def test_spill_lives_in_spark_local_dir_and_is_removed_also_on_failure(spark):
    from spark_estimators.errors import TrainingFailedError

    df = make_df(spark)
    model = make_estimator(callbacks=[SpillProbe()], epochs=1).fit(df)
    last = model.getHistory()[-1]
    assert last["spill_files"] >= 1
    assert last["spill_dir"].startswith(spark.conf.get("spark.local.dir"))
    assert _spills(spark) == []  # removed after the fit
    with pytest.raises(TrainingFailedError, match="probe: this rank fails"):
        make_estimator(callbacks=[SpillProbe(fail_at=0)], epochs=2).fit(df)
    assert _spills(spark) == []


def test_mlflow_logs_a_streamed_fit_with_example_rows_from_the_dataframe(
    spark, tmp_path, monkeypatch
):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    # An experiment of this store: mlflow keeps the one an earlier test made active.
    mlflow.set_experiment("stream_fit")
    try:
        with mlflow.start_run() as run:
            fitted = make_estimator(epochs=1).fit(make_df(spark))
        (logged,) = mlflow.search_logged_models(
            filter_string=f"source_run_id = '{run.info.run_id}'", output_format="list"
        )
        info = mlflow.models.get_model_info(logged.model_uri)
        assert [s.shape for s in info.signature.inputs.inputs] == [(-1, N_FEATURES)]
        loaded = mlflow.pytorch.load_model(logged.model_uri)
        x = torch.ones(2, N_FEATURES)
        with torch.no_grad():
            np.testing.assert_allclose(loaded(x).numpy(), fitted.getModel()(x).numpy())
    finally:
        mlflow.set_tracking_uri(None)


def test_kept_partitions_stream_as_they_are(spark):
    """A DataFrame with num_proc partitions and no shuffle in its plan is not repartitioned.

    The filter leaves 50 and 150 rows in the two partitions of the range: both ranks take
    ceil(150 / 16) = 10 steps (a round-robin repartition would give 100 + 100 rows, 7 steps).
    """
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from spark_estimators.data.stream import keeps_partitions

    x = [F.rand(seed=i) * 2 - 1 for i in range(N_FEATURES)]
    df = (
        spark.range(0, 300, numPartitions=2)
        .where((F.col("id") < 50) | (F.col("id") >= 150))
        .select(F.array(*x).alias("x"))
        .select(
            array_to_vector("x").alias("features"),
            (sum(F.col("x")[i] * float(w) for i, w in enumerate(TRUE_W)) + 0.7).alias("y"),
        )
    )
    assert keeps_partitions(df, 2)
    assert not keeps_partitions(df, 3)
    assert not keeps_partitions(df.repartition(2), 2)
    assert not keeps_partitions(df.groupBy("y").count(), 2)
    model = make_estimator(callbacks=[StepCounter()], epochs=8).fit(df)
    history = model.getHistory()
    assert [h["rank_steps"] for h in history] == [10.0] * 8
    assert history[-1]["loss"] < 0.05 * history[0]["loss"]
