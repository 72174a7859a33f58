"""Issue 18: what the driver can know is checked before any data is written or job started.

Each case failed late before (an executor traceback after the data was written, or an error
on the ranks); here it must fail in the driver, naming the value and the fix.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.data import prepare_data  # noqa: E402
from spark_estimators.errors import ConfigurationError, StoreError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4))
    rows = [(Vectors.dense(r.tolist()), float(r.sum())) for r in x]
    return spark.createDataFrame(rows, ["features", "y"])


def estimator(store, model=None, **kw):
    model = model or torch.nn.Linear(4, 1)
    opts = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def spark_jobs_of(spark, action):
    """Run ``action`` under a fresh job group; return (its exception, the Spark jobs it ran)."""
    sc = spark.sparkContext
    group = f"preflight-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, "preflight test")
    try:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            return exc, sc.statusTracker().getJobIdsForGroup(group)
        return None, sc.statusTracker().getJobIdsForGroup(group)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


def test_unwritable_store_fails_in_the_driver_before_any_job(spark, df, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    store = LocalStore(str(blocker / "store"))
    exc, jobs = spark_jobs_of(spark, lambda: estimator(store).fit(df))
    assert isinstance(exc, StoreError), repr(exc)
    assert str(blocker / "store") in str(exc)
    assert "not writable" in str(exc)
    assert jobs == []


def test_num_proc_over_slots_fails_before_the_data_is_written(spark, df, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    exc, jobs = spark_jobs_of(spark, lambda: estimator(store, num_proc=3).fit(df))
    assert isinstance(exc, ConfigurationError), repr(exc)
    assert "num_proc=3" in str(exc) and "has 2" in str(exc)
    assert jobs == []
    assert store.list_datasets() == []


@pytest.mark.parametrize(
    ("param", "shape"),
    [("input_shapes", [[-1, 3]]), ("input_shapes", [[2, 3]]), ("label_shapes", [[-1, 2]])],
)
def test_shapes_that_cannot_hold_the_rows_fail_before_the_data_is_written(
    spark, df, tmp_path, param, shape
):
    store = LocalStore(str(tmp_path / "store"))
    with pytest.raises(ConfigurationError) as info:
        estimator(store, **{param: shape}).fit(df)
    column = "features" if param == "input_shapes" else "y"
    message = str(info.value)
    assert param in message and repr(column) in message and repr(shape[0]) in message
    assert store.list_datasets() == []


def test_shapes_that_hold_the_rows_are_accepted(spark, df, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    model = estimator(store, input_shapes=[[-1, 2, 2]], model=_Flatten()).fit(df)
    out = model.transform(df.limit(4)).toPandas()
    assert len(out) == 4 and np.isfinite(np.stack(out["y__output"].to_numpy()).astype(float)).all()


class _Flatten(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        assert x.shape[1:] == (2, 2), x.shape  # the shape given, on the ranks and in transform
        return self.fc(x.reshape(len(x), 4))


def test_store_failure_on_an_executor_is_a_store_error_naming_the_path(spark, df, tmp_path):
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the train data directory should be")
    train_path = str(blocker / "train_data")
    store = LocalStore(str(tmp_path / "store"), train_path=train_path)
    with pytest.raises(StoreError) as info:
        prepare_data(2, store, df, ["features"], ["y"], verbose=0)
    message = str(info.value)
    assert train_path in message and "executor" in message
    assert "Traceback" not in message
    assert not os.path.exists(str(tmp_path / "store" / "intermediate_train_data"))


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        y = self.linear(x)
        return y, y * 2


def test_more_outputs_than_label_columns_is_named_before_training(spark, df, tmp_path):
    """Issue 44 item 6: it was a raw ``zip() argument 2 is longer than argument 1``."""
    model = _TwoOutputs()
    est = estimator(LocalStore(str(tmp_path)), model=model)
    with pytest.raises(ConfigurationError) as info:
        est.fit(df)
    assert str(info.value).startswith(
        "the model returns 2 output(s) but there are 1 label column(s) ['y']"
    )


def test_the_rank_side_loss_names_the_output_count_too():
    from spark_estimators.torch.losses import compute_loss

    out = torch.zeros(4, 1)
    with pytest.raises(ValueError, match=r"returns 2 output\(s\) but there are 1 label"):
        compute_loss([torch.nn.MSELoss()], [out, out], [out], None, None)
