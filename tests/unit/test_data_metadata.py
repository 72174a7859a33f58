"""DatasetMetadata: JSON and pickle round trips, loading from a store, Parquet-only description."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import (
    ColumnInfo,
    DatasetMetadata,
    ParquetFileInfo,
    load_dataset_metadata,
)
from spark_estimators.data._writer import stored_schema
from spark_estimators.errors import ConfigurationError, StoreError
from spark_estimators.store import LocalStore


def sample_meta(idx="abc", created="2026-01-01T00:00:00+00:00"):
    return DatasetMetadata(
        dataset_idx=idx,
        cache_key="k" * 64,
        columns={
            "f": ColumnInfo("f", "vector", "float64", (3,), "vector"),
            "y": ColumnInfo("y", "scalar", "float32", (), "float"),
        },
        feature_cols=["f"],
        label_cols=["y"],
        sample_weight_col=None,
        train_path="/s/intermediate_train_data.abc",
        val_path=None,
        train_files=[ParquetFileInfo("/s/t/p0.parquet", 10, 1000, (6, 4))],
        created_at=created,
    )


def test_json_and_pickle_round_trips():
    meta = sample_meta()
    assert DatasetMetadata.from_json(meta.to_json()) == meta
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert (meta.train_rows, meta.train_bytes, meta.val_rows, meta.has_val) == (10, 1000, 0, False)
    assert meta.shapes == {"f": (3,), "y": ()}
    with meta as same:
        assert same is meta


def test_newer_format_is_refused_with_a_fix():
    d = sample_meta().to_dict()
    d["format_version"] = 99
    with pytest.raises(StoreError, match="upgrade spark_estimators"):
        DatasetMetadata.from_json(json.dumps(d))


def test_load_by_index_most_recent_and_missing(tmp_path):
    store = LocalStore(str(tmp_path))
    with pytest.raises(StoreError, match=r"no prepared dataset 'zz'.*\[\]"):
        DatasetMetadata.load(store, "zz")
    sample_meta("old", "2026-01-01T00:00:00+00:00").save(store)
    sample_meta("new", "2026-02-01T00:00:00+00:00").save(store)
    assert DatasetMetadata.load(store, "old").dataset_idx == "old"
    assert DatasetMetadata.load(store).dataset_idx == "new"
    assert load_dataset_metadata(store).dataset_idx == "new"
    with pytest.raises(StoreError, match=r"\['new', 'old'\]"):
        DatasetMetadata.load(store, "zz")


def test_from_parquet_reads_our_schema_metadata(tmp_path):
    store = LocalStore(str(tmp_path))
    cols = (
        ColumnInfo("s", "sparse_vector", "float64", (7,), "vector"),
        ColumnInfo("y", "scalar", "int32", (), "int"),
    )
    schema = stored_schema(cols)
    sparse = pa.array(
        [{"indices": [1], "values": [2.0]}, {"indices": [], "values": []}], schema.field("s").type
    )
    table = pa.table({"s": sparse, "y": pa.array([1, 2], pa.int32())}, schema=schema)
    store.makedirs(store.get_train_data_path())
    pq.write_table(table, store.get_train_data_path() + "/part-0.parquet")
    store.write_text(store.get_train_data_path() + "/_SUCCESS", "")
    meta = load_dataset_metadata(store, feature_cols=["s"], label_cols=["y"])
    assert meta.columns["s"] == cols[0]
    assert [f.rows for f in meta.train_files] == [2]  # _SUCCESS is skipped


def test_from_parquet_infers_plain_files_and_checks_columns(tmp_path):
    store = LocalStore(str(tmp_path))
    store.makedirs(store.get_train_data_path())
    table = pa.table({"a": pa.array([[1, 2, 3]] * 4, pa.list_(pa.int64())), "b": np.arange(4.0)})
    pq.write_table(table, store.get_train_data_path() + "/x.parquet", row_group_size=3)
    meta = DatasetMetadata.from_parquet(store, feature_cols=["a"], label_cols=["b"])
    a = meta.columns["a"]
    assert (a.kind, a.dtype, a.shape) == ("array", "int64", (3,))
    assert meta.columns["b"].kind == "scalar" and meta.columns["b"].dtype == "float64"
    assert meta.train_files[0].row_groups == (3, 1)
    with pytest.raises(ConfigurationError, match=r"\['c'\] are not in the Parquet data"):
        DatasetMetadata.from_parquet(store, feature_cols=["c"])
