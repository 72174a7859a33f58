"""Issue 27 item 7: a newcomer's common mistakes fail in the driver, naming the value and the fix.

Each case failed before with a message that named neither (pyspark's "forces keyword
arguments", "got DataFrame", a bare pickling error, a raw Py4JJavaError) or never finished
(``batch_size=10**9`` spun both ranks in ``torch.cat``).
"""

from __future__ import annotations

import threading

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402
from pyspark.sql.types import DoubleType, StructField, StructType  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def estimator(store, model=None, **kw):
    model = model if model is not None else torch.nn.Linear(2, 1)
    opts = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
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
def rows():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 2))
    return [(Vectors.dense(r.tolist()), float(r @ [1.0, -1.0])) for r in x]


SCHEMA = StructType([StructField("features", VectorUDT()), StructField("y", DoubleType())])


def test_positional_arguments_are_named_with_the_fix():
    net = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError) as info:
        TorchEstimator(net)
    message = str(info.value)
    assert "keyword arguments only" in message and "Linear" in message, message
    assert "TorchEstimator(model=" in message, message


def test_a_pandas_dataframe_names_spark_create_dataframe(tmp_path):
    pdf = pd.DataFrame({"features": [[1.0, 2.0]], "y": [1.0]})
    with pytest.raises(ConfigurationError) as info:
        estimator(LocalStore(str(tmp_path))).fit(pdf)
    message = str(info.value)
    assert "pandas" in message and "spark.createDataFrame(pdf)" in message, message


def test_a_model_class_instead_of_an_instance(spark, tmp_path, rows):
    df = spark.createDataFrame(rows, SCHEMA)
    est = estimator(LocalStore(str(tmp_path)))
    est.setModel(torch.nn.Linear)
    with pytest.raises(ConfigurationError) as info:
        est.fit(df)
    assert "model=Linear is a class" in str(info.value) and "Linear(...)" in str(info.value)


class _WithLock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.fc(x)


def test_a_model_that_cannot_be_pickled_names_the_attribute(spark, tmp_path, rows):
    df = spark.createDataFrame(rows, SCHEMA)
    with pytest.raises(ConfigurationError) as info:
        estimator(LocalStore(str(tmp_path)), model=_WithLock()).fit(df)
    first = str(info.value).splitlines()[0]
    assert first.startswith("model.lock cannot be pickled"), first
    assert "model.lock: _thread.lock" in first, first


def test_null_feature_vectors_name_the_column_and_count(spark, tmp_path, rows):
    df = spark.createDataFrame(rows[:40] + [(None, 1.0)] * 3, SCHEMA)
    with pytest.raises(ConfigurationError) as info:
        estimator(LocalStore(str(tmp_path))).fit(df)
    message = str(info.value)
    # Counted during the write like other nulls (issue 40), not a JVM error afterwards.
    assert "null" in message and "'features': 3" in message, message
    assert "df.na.drop" in message and "drop_invalid_rows=True" in message, message


def test_drop_invalid_rows_is_accepted_by_the_estimator(spark, tmp_path, rows):
    """The NaN-label message suggests drop_invalid_rows=True: the estimator takes it."""
    df = spark.createDataFrame(rows[:64] + [(Vectors.dense([0.0, 1.0]), float("nan"))] * 5, SCHEMA)
    store = LocalStore(str(tmp_path))
    with pytest.raises(ConfigurationError, match="drop_invalid_rows=True"):
        estimator(store).fit(df)
    model = estimator(store, drop_invalid_rows=True).fit(df)
    losses = [h["loss"] for h in model.getHistory()]
    # A NaN label row left in would make the loss NaN.
    assert len(losses) == 2 and all(np.isfinite(losses)), losses


@pytest.mark.timeout(120)
def test_a_batch_larger_than_the_data_finishes_with_one_step_per_epoch(spark, tmp_path, rows):
    df = spark.createDataFrame(rows, SCHEMA)
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    model = estimator(LocalStore(str(tmp_path)), model=net, batch_size=10**9).fit(df)
    history = model.getHistory()
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history), history
