"""ReaderOptions: one value for the reader settings; keywords keep working and override it."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import DatasetMetadata, ReaderOptions, make_batch_reader
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore


@pytest.fixture
def meta_and_store(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    path = store.get_train_data_path()
    store.makedirs(path)
    ids = np.arange(60)
    table = pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array(ids / 2, pa.float32())})
    pq.write_table(table, f"{path}/part-000.parquet", row_group_size=8)
    meta = DatasetMetadata.from_parquet(store, path, feature_cols=["id"], label_cols=["x"])
    return meta, store


def ids(reader):
    return np.concatenate([b["id"] for b in reader]).tolist()


def test_options_give_the_same_batches_as_the_keywords(meta_and_store):
    meta, store = meta_and_store
    opts = ReaderOptions(batch_size=7, seed=4, epoch=2, prefetch=1, columns=["id", "x"])
    with_options = make_batch_reader(store, meta, opts, rank=1, size=2)
    with_keywords = make_batch_reader(
        store, meta, rank=1, size=2, batch_size=7, seed=4, epoch=2, prefetch=1, columns=["id", "x"]
    )
    assert with_options.batch_size == 7 and with_options.epoch == 2
    assert ids(with_options) == ids(with_keywords)
    assert ids(with_options) != list(range(30, 60))[: len(ids(with_keywords))]  # shuffled


def test_keywords_override_the_options(meta_and_store):
    meta, store = meta_and_store
    opts = ReaderOptions(batch_size=7, shuffle=True)
    reader = make_batch_reader(store, meta, options=opts, rank=0, size=1, shuffle=False)
    assert reader.batch_size == 7 and reader.shuffle is False
    got = ids(reader)  # 9 full batches of 7: the file order, then wrapped around
    assert len(got) == 63 and got[:60] == list(range(60))
    assert opts.shuffle is True  # the options value itself is unchanged


def test_options_are_frozen_picklable_and_normalised():
    opts = ReaderOptions(columns=["a", "b"], stack_columns={"x": ["a", "b"]})
    assert opts.columns == ("a", "b") and opts.stack_columns == {"x": ("a", "b")}
    assert pickle.loads(pickle.dumps(opts)) == opts
    with pytest.raises(AttributeError):
        opts.batch_size = 3  # type: ignore[misc]
    assert opts.replace(batch_size=3).batch_size == 3 and opts.batch_size == 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": True}, "batch_size=True"),
        ({"prefetch": -1}, "prefetch=-1"),
        ({"num_workers": 0}, "num_workers=0"),
        ({"shuffle_buffer_size": -5}, "shuffle_buffer_size=-5"),
        ({"reader": "tfrecord"}, "reader='tfrecord'"),
        ({"columns": "id"}, "not a string"),
    ],
)
def test_bad_options_fail_when_built(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        ReaderOptions(**kwargs)


def test_unknown_keywords_and_wrong_options_type_are_explained(meta_and_store):
    meta, store = meta_and_store
    with pytest.raises(ConfigurationError, match=r"unknown reader option\(s\) \['batchsize'\]"):
        make_batch_reader(store, meta, rank=0, size=1, batchsize=4)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="must be a ReaderOptions"):
        make_batch_reader(store, meta, {"batch_size": 4}, rank=0, size=1)  # type: ignore[arg-type]
