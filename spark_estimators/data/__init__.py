"""DataFrame -> Parquet preparation (keyed, cached) and executor-side readers.

Public API
----------
``prepare_data(num_proc, store, df, feature_cols, label_cols=None, validation=None,
sample_weight_col=None, compress_sparse=False, partitions_per_process=None, verbose=1, *, seed=42,
drop_invalid_rows=False) -> DatasetMetadata``
    Driver only. Writes (or reuses) a prepared dataset; see :mod:`spark_estimators.data.prepare`.
``DatasetMetadata``
    Columns (kind, dtype, per-row shape), row counts, bytes, Parquet files with row-group sizes,
    ``dataset_idx``, ``cache_key``. Picklable; ``DatasetMetadata.load(store, dataset_idx)`` reads a
    prepared dataset, ``DatasetMetadata.from_parquet(store, train_path=None, val_path=None, ...)``
    describes existing Parquet (``fit_on_parquet`` without ``prepare_data``).
``load_dataset_metadata(store, dataset_idx=None, feature_cols=None, label_cols=None,
sample_weight_col=None)``
    What ``fit_on_parquet(dataset_idx=...)`` needs: a prepared dataset by index, else the store's
    un-indexed train/val Parquet.
``ReaderOptions(batch_size=32, columns=None, shuffle=True, seed=0, epoch=0,
shuffle_buffer_size=None, inmemory_cache=False, transformation_fn=None, stack_columns=None,
prefetch=2, num_workers=2, reader="arrow")``
    The reader settings as one frozen value; ``.replace(**changes)``.
``make_batch_reader(store_or_view, metadata, options=None, *, split="train", rank=None,
size=None, **settings)``
    Executor side. ``settings`` are ``ReaderOptions`` fields and override ``options``. Equal
    ``steps_per_epoch`` on every rank; ``iter()`` yields ``{col: ndarray}`` per batch, one epoch per
    ``iter()``; see :mod:`spark_estimators.data.reader`.
``torch_batches(reader, shapes=None, dtypes=None)``, ``tf_dataset(reader, feature_cols,
label_cols=(), sample_weight_col=None, shapes=None)``
    Framework adapters (import torch / tensorflow lazily).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_estimators.data.adapters import TorchBatches, tf_dataset, torch_batches
from spark_estimators.data.metadata import ColumnInfo, DatasetMetadata, ParquetFileInfo
from spark_estimators.data.options import ReaderOptions
from spark_estimators.data.prepare import prepare_data
from spark_estimators.data.reader import BatchReader, make_batch_reader

if TYPE_CHECKING:
    from spark_estimators.store.base import StoreBase


def load_dataset_metadata(
    store: StoreBase,
    dataset_idx: int | str | None = None,
    *,
    feature_cols: Sequence[str] | None = None,
    label_cols: Sequence[str] | None = None,
    sample_weight_col: str | None = None,
) -> DatasetMetadata:
    """The dataset ``fit_on_parquet(dataset_idx=...)`` trains on.

    ``dataset_idx`` given: that prepared dataset. Otherwise the most recent prepared dataset of
    the store (see :meth:`DatasetMetadata.load`), and when there is none, the Parquet data at the
    store's un-indexed train/val paths described from the files (horovod's ``fit_on_parquet``;
    ``feature_cols``/``label_cols`` then pick and check the columns).
    """
    if (
        dataset_idx is not None
        or store.exists(store.get_dataset_metadata_path(None))
        or store.list_datasets()
    ):
        return DatasetMetadata.load(store, dataset_idx)
    return DatasetMetadata.from_parquet(
        store,
        feature_cols=feature_cols,
        label_cols=label_cols,
        sample_weight_col=sample_weight_col,
    )


__all__ = [
    "BatchReader",
    "ColumnInfo",
    "DatasetMetadata",
    "ParquetFileInfo",
    "ReaderOptions",
    "TorchBatches",
    "load_dataset_metadata",
    "make_batch_reader",
    "prepare_data",
    "tf_dataset",
    "torch_batches",
]
