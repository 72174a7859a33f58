"""Issue 27 item 4: one epoch convention (spark_estimators.core.progress's docstring).

History entries, callbacks and MLflow steps carry the 0-based index (Keras History, horovod);
every line a person reads says ``epoch 1/N`` for the entry with ``epoch`` 0. Before, the demo
printed ``epoch 0`` under live lines that said ``epoch 1/6`` (and, until issue 41, each epoch's
line twice).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mlflow = pytest.importorskip("mlflow")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators import demo  # noqa: E402
from spark_estimators.core.progress import history_lines  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

LINE = re.compile(r"^(epoch \d+/\d+): ")


def test_live_lines_history_callbacks_and_mlflow_steps_agree(spark, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 2))
    df = spark.createDataFrame(
        [(Vectors.dense(r.tolist()), float(r.sum())) for r in x], ["features", "y"]
    )

    class Seen:
        def __init__(self):
            self.epochs = []

        def on_epoch_end(self, epoch, logs):
            self.epochs.append((epoch, logs["epoch"]))

    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=3,
        verbose=1,
        callbacks=[Seen()],
    )
    try:
        with mlflow.start_run() as run:
            fitted = est.fit(df)
        client = mlflow.tracking.MlflowClient()
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    finally:
        mlflow.set_tracking_uri(None)
    history = fitted.getHistory()
    live = [line for line in capsys.readouterr().out.splitlines() if LINE.match(line)]
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert sorted(steps) == [0, 1, 2]
    assert live == history_lines(history, 3)
    assert [LINE.match(line).group(1) for line in live] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]


def test_the_demo_prints_each_epoch_line_once(spark, tmp_path, capsys):
    """Issue 41: the demo printed its epoch lines twice (live, then again from the history)."""
    demo._fit_and_report(spark, LocalStore(str(tmp_path / "store")), n_rows=512, epochs=2)
    out = capsys.readouterr().out.splitlines()
    epoch_lines = [line for line in out if re.search(r"\bepoch \d+/\d+\b", line)]
    assert [LINE.match(line).group(1) for line in epoch_lines] == ["epoch 1/2", "epoch 2/2"], out
    # the summary says how the fit went, without repeating the epochs
    assert any(re.match(r"  loss: \S+ -> \S+ over 2 epochs$", line) for line in out), out
    assert any(line.startswith("test rows: ") and "R^2 = " in line for line in out), out
