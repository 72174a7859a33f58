"""Stores: where prepared data, checkpoints and logs live.

Public API
----------
``Store.create(url, **kw)``
    Picks the class by scheme: plain path / ``file://`` -> :class:`LocalStore`; ``s3://``,
    ``gs://``, ``abfs://``, ... -> :class:`FilesystemStore` (``storage_options=`` for fsspec);
    ``hdfs://`` -> :class:`HDFSStore`; ``dbfs:/`` (and on Databricks ``/dbfs/``,
    ``file:///dbfs/``) -> :class:`DBFSLocalStore`.
Layout
    ``get_train_data_path(idx=None)``, ``get_val_data_path(idx=None)``,
    ``get_test_data_path(idx=None)``, ``get_dataset_metadata_path(idx=None)``,
    ``get_run_path(run_id)``, ``get_checkpoint_path(run_id)`` (a directory),
    ``get_logs_path(run_id)``.
I/O (paths are full store paths or relative to the prefix)
    ``read_bytes``, ``read_text``, ``open_read``, ``write_bytes(path, data, atomic=False)``,
    ``write_text``, ``write_bytes_atomic``, ``open_write(path, atomic=False)``, ``upload_file``,
    ``download_file``, ``exists``, ``isdir``, ``stat``, ``listdir``, ``makedirs``, ``delete``,
    ``sync_dir(local_dir, run_id, subdir="")``.
horovod's names
    ``get_full_path`` (a URL: ``file:///...``, ``s3://...``), ``get_localized_path`` (the path on
    the store's filesystem client), ``read``, ``is_parquet_dataset``, ``get_parquet_dataset``;
    ``DBFSLocalStore.matches_dbfs`` / ``normalize_path``. LocalStore is a FilesystemStore.
Runs and datasets
    ``list_runs()``, ``delete_run(run_id)``, ``list_datasets()``, ``delete_dataset(idx)``.
Executors
    ``store.to_remote(run_id=None, dataset_idx=None)`` -> :class:`RemoteStore`, picklable, same
    layout and I/O; it carries configuration only and builds clients in the receiving process.

See :mod:`spark_estimators.store.base` for the layout and the atomic-write guarantees.
"""

from __future__ import annotations

from spark_estimators.store import registry as _registry  # noqa: F401  (installs Store.create)
from spark_estimators.store.base import FileStat, RemoteStore, Store, StoreBase
from spark_estimators.store.filesystem import FilesystemStore, HDFSStore
from spark_estimators.store.local import DBFSLocalStore, LocalStore

__all__ = [
    "DBFSLocalStore",
    "FileStat",
    "FilesystemStore",
    "HDFSStore",
    "LocalStore",
    "RemoteStore",
    "Store",
    "StoreBase",
]
