"""prepare_data and the reader through every store: local, fsspec file://, S3 (moto), DBFS."""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.data import DatasetMetadata, make_batch_reader, prepare_data

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


def test_prepare_read_and_reuse_through_each_store(spark, store):
    def frame():
        return spark.range(150).selectExpr(
            "id", "array(cast(id as float), cast(-id as float)) as arr", "id % 3 = 0 as v"
        )

    meta = prepare_data(2, store, frame(), ["id"], ["arr"], validation="v")
    assert (meta.train_rows, meta.val_rows) == (100, 50)
    assert all(f.path.startswith(store.prefix_path) for f in meta.train_files + meta.val_files)
    assert store.list_datasets() == [meta.dataset_idx]

    seen = []
    for rank in (0, 1):
        reader = make_batch_reader(store.to_remote(), meta, rank=rank, size=2, batch_size=10)
        for batch in reader:
            np.testing.assert_array_equal(batch["arr"][:, 1], -batch["id"])
            seen.extend(batch["id"].tolist())
    assert sorted(seen) == [i for i in range(150) if i % 3]

    stamps = {f.path: store.stat(f.path).mtime_ns for f in meta.train_files}
    again = prepare_data(2, store, frame(), ["id"], ["arr"], validation="v")
    assert again == meta
    assert {f.path: store.stat(f.path).mtime_ns for f in meta.train_files} == stamps
    assert DatasetMetadata.load(store, meta.dataset_idx) == meta

    store.delete_dataset(meta.dataset_idx)
    assert store.list_datasets() == [] and not store.exists(meta.train_files[0].path)
