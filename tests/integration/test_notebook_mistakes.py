"""Issue 41: what a notebook user runs into, each failing before with an error that hid the cause.

- ``fit`` after ``spark.stop()`` (a cell re-run after the session was stopped);
- a model with more or fewer outputs than label columns (the count mismatch leads the message);
- a column-name typo in ``feature_cols``/``label_cols`` or at ``transform`` ("did you mean");
- ``plot_history`` importable from the estimator packages, where users look for it;
- TensorBoard scalars of a TorchEstimator run in ``store.get_logs_path(run_id)``;
- ``transform`` of null vectors (the documented ValueError, naming the column) and of a
  Structured Streaming DataFrame with a vector feature column.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402
from pyspark.sql.types import DoubleType, StructField, StructType  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCHEMA = StructType(
    [
        StructField("features", VectorUDT()),
        StructField("y", DoubleType()),
        StructField("y2", DoubleType()),
    ]
)
W = np.array([1.5, -2.0])


def estimator(store, model=None, **kw):
    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(2, 1)
    opts = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


@pytest.fixture(scope="module")
def df(spark):
    x = np.random.default_rng(4).normal(size=(96, 2))
    rows = [(Vectors.dense(r.tolist()), float(r @ W), float(r[0])) for r in x]
    return spark.createDataFrame(rows, SCHEMA).cache()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("nb-mistakes")))


@pytest.fixture(scope="module")
def fitted(store, df):
    return estimator(store, run_id="tb_run").fit(df)


def test_fit_after_spark_stop_says_the_session_is_stopped(tmp_path):
    # Its own session in a subprocess: the shared one must stay up.
    script = textwrap.dedent(
        f"""
        import torch
        from pyspark.ml.linalg import Vectors
        from spark_estimators.core.session import create_local_session
        from spark_estimators.errors import ConfigurationError
        from spark_estimators.store import LocalStore
        from spark_estimators.torch import TorchEstimator

        spark = create_local_session()
        df = spark.createDataFrame([(Vectors.dense([1.0, 2.0]), 1.0)] * 8, ["features", "y"])
        spark.stop()
        net = torch.nn.Linear(2, 1)
        est = TorchEstimator(
            num_proc=1, store=LocalStore({str(tmp_path / "store")!r}), model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=torch.nn.MSELoss(),
            feature_cols=["features"], label_cols=["y"], epochs=1, verbose=0,
        )
        try:
            est.fit(df)
        except ConfigurationError as exc:
            print("ERROR:", exc)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ERROR:"))
    assert "stopped SparkSession" in line and "spark.stop()" in line, line
    assert not os.path.exists(tmp_path / "store" / "data"), "data was prepared after the stop"


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize(
    ("model", "labels", "lead"),
    [
        (TwoHeads, ["y"], "the model returns 2 output(s) but there are 1 label column(s) ['y']"),
        (
            lambda: torch.nn.Linear(2, 1),
            ["y", "y2"],
            "the model returns 1 output(s) but there are 2 label column(s) ['y', 'y2']",
        ),
    ],
)
def test_an_output_count_mismatch_leads_its_message(store, df, model, labels, lead):
    with pytest.raises(ConfigurationError) as info:
        estimator(store, model(), label_cols=labels).fit(df)
    assert str(info.value).startswith(lead), str(info.value)


def test_a_column_typo_gets_did_you_mean(store, df, fitted):
    with pytest.raises(ConfigurationError, match=r"did you mean 'features'\?"):
        estimator(store, feature_cols=["featurs"]).fit(df)
    with pytest.raises(ConfigurationError) as info:
        estimator(store, label_cols=["Y"], feature_cols=["Features"]).fit(df)
    assert "did you mean 'features' for 'Features', 'y' for 'Y'?" in str(info.value)
    with pytest.raises(ConfigurationError, match=r"did you mean 'feature'\?"):
        fitted.transform(df.withColumnRenamed("features", "feature"))


def test_plot_history_is_exported_by_every_estimator_package():
    from spark_estimators.core.progress import plot_history

    for package in ("torch", "lightning", "keras"):
        module = __import__(f"spark_estimators.{package}", fromlist=["plot_history"])
        assert module.plot_history is plot_history, package
        assert "plot_history" in module.__all__, package


def test_torch_tensorboard_scalars_are_in_the_logs_path(store, fitted):
    logs = store.get_logs_path("tb_run")
    events = [n for n in store.listdir(logs) if n.startswith("events.out.tfevents")]
    assert events, store.listdir(store.get_run_path("tb_run"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(store.fs_path(logs))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("loss")]
    np.testing.assert_allclose(losses, [h["loss"] for h in fitted.getHistory()], rtol=1e-5)


def test_transform_of_null_vectors_names_the_column(spark, fitted):
    rows = [(Vectors.dense([1.0, 2.0]), 0.0, 0.0), (None, 0.0, 0.0), (None, 1.0, 0.0)]
    with pytest.raises(Exception) as info:
        fitted.transform(spark.createDataFrame(rows, SCHEMA)).collect()
    message = str(info.value)
    assert "a feature column has null rows; drop or fill them before transform" in message
    assert "column 'features' has 2 null row(s)" in message, message[-2000:]


def test_transform_of_a_streaming_dataframe_with_vector_features(spark, fitted, tmp_path):
    source = tmp_path / "source"
    x = np.random.default_rng(9).normal(size=(20, 2))
    spark.createDataFrame([(Vectors.dense(r.tolist()), 0.0, 0.0) for r in x], SCHEMA).write.parquet(
        str(source)
    )
    stream = spark.readStream.schema(SCHEMA).parquet(str(source))
    assert stream.isStreaming
    query = (
        fitted.transform(stream)
        .writeStream.format("memory")
        .queryName("scored_stream")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        assert query.awaitTermination(180), "the availableNow query did not finish"
        assert query.exception() is None, query.exception()
        out = spark.table("scored_stream").collect()
    finally:
        query.stop()
    net = fitted.getModel()
    got = sorted((tuple(r["features"].toArray()), r["y__output"]) for r in out)
    with torch.no_grad():
        want = sorted(
            (tuple(r.tolist()), float(net(torch.tensor(r, dtype=torch.float32)).item())) for r in x
        )
    assert len(got) == 20
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-5)
