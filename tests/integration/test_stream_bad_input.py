"""data="stream" with bad input: clear errors naming the column, never a hang or a torch error.

What needs no job fails in the driver before any Spark job (a missing column, a string column);
nulls and NaNs are only seen in the rows, so the rank that first decodes such a row fails the fit
with a ``TrainingFailedError`` naming the column, the value and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError, TrainingFailedError  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402
from tests.integration.test_prepare_data_errors import jobs_run_by  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def make_df(spark, bad=None, n=200):
    """Rows of (features, y, name); ``bad`` spoils every 50th row of one column."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3))
    rows = []
    for i in range(n):
        features, y = Vectors.dense(x[i].tolist()), float(x[i].sum())
        if i % 50 == 7 and bad == "y":
            y = None
        if i % 50 == 7 and bad == "features":
            features = Vectors.dense([1.0, float("nan"), 2.0])
        rows.append((features, y, "a"))
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("features", VectorUDT()),
            StructField("y", DoubleType()),
            StructField("name", StringType()),
        ]
    )
    return spark.createDataFrame(rows, schema)


def make_estimator(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opts = dict(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        verbose=0,
        data="stream",
    )
    opts.update(kw)
    return TorchEstimator(**opts)


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (dict(feature_cols=["features", "nope"]), r"\['nope'\] not found.*available columns"),
        (dict(label_cols=["missing"]), r"\['missing'\] not found"),
        (dict(label_cols=["name"]), r"'name' is a string column.*StringIndexer\(inputCol='name'"),
    ],
)
def test_missing_or_string_columns_fail_in_the_driver_before_any_job(spark, columns, message):
    df = make_df(spark)

    def fit():
        with pytest.raises(ConfigurationError, match=message):
            make_estimator(**columns).fit(df)

    assert jobs_run_by(spark, fit) == []


@pytest.mark.parametrize(("column", "value"), [("y", "None"), ("features", "[1.0, nan, 2.0]")])
def test_null_or_nan_in_a_used_column_fails_the_fit_naming_it(spark, column, value):
    with pytest.raises(TrainingFailedError) as caught:
        make_estimator().fit(make_df(spark, bad=column))
    message = str(caught.value)
    assert message.startswith(f"ConfigurationError: column {column!r} has null or NaN values")
    assert f"e.g. {value}" in message
    assert f"df.na.drop(subset=[{column!r}])" in message
    # The rank that read the row reports it (the other rank is stopped, not failed on its own).
    failures = caught.value.worker_failures
    assert any(f"column {column!r}" in str(err) for err in failures.values())
