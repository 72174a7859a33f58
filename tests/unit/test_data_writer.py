"""The executor-side Parquet writer, run directly on Arrow batches (no Spark job).

Batches shaped like Spark's (``list<element: double>``, 10,000 rows each), with more values per
column chunk than the writer's pyarrow write batch (:data:`WRITE_BATCH_VALUES`), so the pages
and row groups it cuts are checked against the rows that went in.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_estimators.data._writer import WRITE_BATCH_VALUES, PartitionWriter
from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.store import LocalStore

FEATURES = 32
BATCH = 10_000
SPARK_LIST = pa.list_(pa.field("element", pa.float64()))


def spark_batches(rows: int, nan_at: int | None = None) -> tuple[list[pa.RecordBatch], np.ndarray]:
    values = np.random.default_rng(3).random((rows, FEATURES))
    if nan_at is not None:
        values[nan_at, 5] = np.nan
    offsets = pa.array(np.arange(0, BATCH * FEATURES + 1, FEATURES, dtype=np.int32))
    batches = []
    for lo in range(0, rows, BATCH):
        flat = pa.array(values[lo : lo + BATCH].ravel())
        features = pa.ListArray.from_arrays(offsets, flat, type=SPARK_LIST)
        label = pa.array(np.nansum(values[lo : lo + BATCH], axis=1))
        batches.append(pa.RecordBatch.from_arrays([features, label], names=["features", "y"]))
    return batches, values


def run_writer(tmp_path, batches, slices):
    store = LocalStore(str(tmp_path))
    columns = (
        ColumnInfo("features", "vector", "float64", (FEATURES,), "vector"),
        ColumnInfo("y", "scalar", "float64", (), "double"),
    )
    writer = PartitionWriter(
        spec=store.filesystem_spec,
        train_dir=store.get_train_data_path("w"),
        val_dir=None,
        token="tok",
        columns=columns,
        split_col=None,
        drop_invalid=False,
        row_group_bytes=1 << 20,
        max_file_bytes=4 << 20,
        slices=slices,
    )
    (out,) = list(writer(iter(batches)))
    lines = [json.loads(line) for line in out.column("info").to_pylist()]
    return [d for d in lines if "path" in d], next(d["stats"] for d in lines if "stats" in d)


def test_files_hold_every_row_in_order_with_large_write_batches(tmp_path):
    rows = 60_000  # 1.9M feature values: each column chunk spans many pyarrow write batches
    assert rows * FEATURES > 8 * WRITE_BATCH_VALUES
    batches, values = spark_batches(rows)
    files, stats = run_writer(tmp_path, batches, slices=2)
    assert stats["rows_in"] == rows and stats["invalid"] == {}
    assert len(files) > 2  # several files per slice: the 4 MiB rollover cut them
    got = {0: [], 1: []}
    for f in sorted(files, key=lambda f: f["path"]):
        table = pq.read_table(f["path"])
        parquet = pq.ParquetFile(f["path"]).metadata
        assert [parquet.row_group(i).num_rows for i in range(parquet.num_row_groups)] == f[
            "row_groups"
        ]
        assert table.num_rows == f["rows"] == sum(f["row_groups"])
        slice_k = int(f["path"].rsplit("/", 1)[1][1:4])
        flat = table.column("features").combine_chunks().flatten().to_numpy()
        got[slice_k].append(flat.reshape(-1, FEATURES))
    # Slice k of every 10,000-row batch went to slice k's files, in order.
    expected = {
        k: [b[k * BATCH // 2 : (k + 1) * BATCH // 2] for b in np.split(values, 6)] for k in (0, 1)
    }
    for k in (0, 1):
        np.testing.assert_array_equal(np.concatenate(got[k]), np.concatenate(expected[k]))


def test_a_nan_past_the_first_write_batch_is_counted_and_nothing_is_kept(tmp_path):
    batches, _ = spark_batches(30_000, nan_at=23_456)
    files, stats = run_writer(tmp_path, batches, slices=1)
    assert stats["invalid"] == {"features": 1}
    assert files == []
    assert not list((tmp_path).rglob("*.parquet"))
