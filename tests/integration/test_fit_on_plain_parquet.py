"""fit_on_parquet on Parquet written by anyone (Spark's own writer, pyarrow), not by prepare_data.

Horovod's ``fit_on_parquet`` trains on whatever Parquet sits at the store's train (and val) paths;
the column facts then come from the files themselves (schema + first row).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError, StoreError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    return x, x @ TRUE_W + 0.7


def _estimator(store, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opts = dict(
        num_proc=2,
        store=store,
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


def _check_fit(model, x):
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.05 < history[0]["loss"]
    w = model.getModel().weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)
    return history


def test_fit_on_parquet_written_by_spark_with_ml_vectors_and_val(spark, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    x, y = _data(512, 0)
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(y))]
    df = spark.createDataFrame(rows, ["features", "y"])
    train, val = df.randomSplit([0.75, 0.25], seed=3)
    # Spark's own writer: VectorUDT structs, _SUCCESS and .crc files beside the data.
    train.repartition(2).write.parquet(store.get_train_data_path())
    val.repartition(1).write.parquet(store.get_val_data_path())

    model = _estimator(store).fit_on_parquet()

    history = _check_fit(model, x)
    assert history[-1]["val_loss"] < 0.05
    got = model.transform(df).select("y__output").collect()
    with torch.no_grad():
        want = model.getModel()(torch.tensor(x, dtype=torch.float32)).numpy().ravel()
    np.testing.assert_allclose([r["y__output"] for r in got], want, rtol=1e-5, atol=1e-5)


def test_fit_on_parquet_written_by_pyarrow_with_list_columns(tmp_path, spark):
    store = LocalStore(str(tmp_path / "store"))
    x, y = _data(512, 1)
    path = store.get_train_data_path()
    store.makedirs(path)
    features = pa.array(list(x.astype(np.float32)), type=pa.list_(pa.float32()))
    for part in range(2):  # two files, so the shards come from different files
        sl = slice(part * 256, (part + 1) * 256)
        table = pa.table({"features": features[sl], "y": pa.array(y[sl]), "extra": pa.array(y[sl])})
        pq.write_table(table, f"{store.full_path(path)}/part-{part}.parquet", row_group_size=64)

    _check_fit(_estimator(store).fit_on_parquet(), x)


def test_fit_on_parquet_names_missing_column_and_empty_store(tmp_path, spark):
    store = LocalStore(str(tmp_path / "store"))
    with pytest.raises(StoreError, match="no Parquet files under"):
        _estimator(store).fit_on_parquet()
    path = store.get_train_data_path()
    store.makedirs(path)
    table = pa.table(
        {"features": pa.array([[1.0, 2.0, 3.0, 4.0]] * 8), "label": pa.array([1.0] * 8)}
    )
    pq.write_table(table, f"{store.full_path(path)}/part-0.parquet")
    with pytest.raises(ConfigurationError, match=r"\['y'\].*available: \['features', 'label'\]"):
        _estimator(store).fit_on_parquet()
