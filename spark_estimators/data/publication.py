"""A written dataset's last steps: its tasks' reports become metadata, published or discarded.

Shared by ``prepare_data`` (:mod:`spark_estimators.data.prepare`) and ``data="parquet+stream"``
(:mod:`spark_estimators.data.stream_copy`), whose barrier tasks write the same files with the
same writer (:class:`~spark_estimators.data._writer.PartitionSink`): the metadata file is written
last and atomically, so its presence means the dataset is complete, and a write that fails
leaves none of its files behind.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from spark_estimators.data.columns import EMPTY_MESSAGE
from spark_estimators.data.metadata import (
    ColumnInfo,
    DatasetMetadata,
    ParquetFileInfo,
    now_iso,
)
from spark_estimators.errors import ConfigurationError
from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)


def load_complete(store: StoreBase, idx: str, cache_key: str) -> DatasetMetadata | None:
    """The published dataset ``idx`` of ``store`` if it has ``cache_key``, else None."""
    path = store.get_dataset_metadata_path(idx)
    if not store.exists(path):
        return None
    meta = DatasetMetadata.from_json(store.read_text(path))
    if meta.cache_key != cache_key:
        logger.warning("dataset %s in %r has another cache key; preparing it again", idx, store)
        return None
    return meta


def bad_data_error(
    columns: list[ColumnInfo],
    invalid: dict[str, int],
    bad_length: dict[str, list[Any]],
    drop_invalid: bool,
) -> ConfigurationError | None:
    """The error for the bad rows the write tasks counted, or None when there are none."""
    sizes = {c.name: c.size for c in columns}
    if bad_length:
        name, (count, example) = min(bad_length.items())
        return ConfigurationError(
            f"column {name!r} has {count} row(s) whose length differs from {sizes[name]} (e.g. "
            f"{example}); every row of an array or vector column must have the same length"
        )
    if invalid and not drop_invalid:
        detail = ", ".join(f"{name!r}: {n}" for name, n in sorted(invalid.items()))
        return ConfigurationError(
            f"null or NaN values in rows of column(s) {detail} (rows per column); fill or drop "
            "them first (df.na.fill / df.na.drop), or pass drop_invalid_rows=True to drop them"
        )
    return None


def sweep(
    store: StoreBase, dirs: list[str], token: str, keep: dict[str, list[ParquetFileInfo]]
) -> None:
    """Delete this preparation's files that the result does not name (failed attempts)."""
    kept = {f.path.rsplit("/", 1)[1] for files in keep.values() for f in files}
    for d in dirs:
        for name in store.listdir(d):
            if f"-{token}-" in name and name not in kept:
                store.delete(f"{d.rstrip('/')}/{name}")


def discard(store: StoreBase, dirs: list[str], token: str, existed: set[str]) -> None:
    """Remove what a failed preparation wrote: its files, and the directories it created.

    A directory that existed before (another process preparing the same dataset) or that holds
    other files now is kept. Errors are logged, not raised: the failure being cleaned up after
    is the one the caller reports.
    """
    try:
        sweep(store, dirs, token, {})
        for d in dirs:
            if d not in existed and store.exists(d) and not store.listdir(d):
                store.delete(d)
    except Exception as exc:
        logger.warning("prepare_data: could not remove the partial output in %s: %s", dirs, exc)


def publish(store: StoreBase, meta: DatasetMetadata) -> DatasetMetadata:
    """Write the metadata unless another process published this dataset first."""
    path = store.get_dataset_metadata_path(meta.dataset_idx)
    if store.exists(path):
        theirs = DatasetMetadata.from_json(store.read_text(path))
        if theirs.cache_key == meta.cache_key:
            for f in meta.train_files + meta.val_files:
                store.delete(f.path)
            return theirs
    meta.save(store)
    return meta


def written_dataset(
    store: StoreBase,
    idx: str,
    cache_key: str,
    columns: list[ColumnInfo],
    params: dict[str, Any],
    lines: list[str],
    token: str,
    dirs: list[str],
    existed: set[str],
    drop_invalid: bool,
) -> DatasetMetadata:
    """The dataset that write tasks reported in ``lines`` (one JSON line per file, then stats).

    Files of failed task attempts (named with ``token`` but in no line) are deleted. Bad rows
    (nulls or NaNs without ``drop_invalid``, wrong lengths) or no training rows raise
    :class:`~spark_estimators.errors.ConfigurationError` after every file of ``token`` and the
    directories this write created (``dirs`` less ``existed``) are removed. ``dirs[0]`` is the
    train directory, ``dirs[1]`` (if any) the validation one. Nothing is published here
    (:func:`publish`).
    """
    train_dir, val_dir = dirs[0], (dirs[1] if len(dirs) > 1 else None)
    files: dict[str, list[ParquetFileInfo]] = {"train": [], "val": []}
    invalid: dict[str, int] = {}
    bad_length: dict[str, list[Any]] = {}
    dropped = 0
    for line in lines:
        d = json.loads(line)
        if "stats" in d:
            for name, n in d["stats"]["invalid"].items():
                invalid[name] = invalid.get(name, 0) + n
            for name, (n, example) in d["stats"]["bad_length"].items():
                count, seen = bad_length.get(name, [0, None])
                bad_length[name] = [count + n, seen if seen is not None else example]
            dropped += d["stats"]["dropped"]
        else:
            files[d["split"]].append(ParquetFileInfo.from_dict(d))
    problem = bad_data_error(columns, invalid, bad_length, drop_invalid)
    if problem is None and not files["train"] and not files["val"] and not dropped:
        problem = ConfigurationError(EMPTY_MESSAGE)  # no sample job ran to find it before
    if problem is not None or not files["train"]:
        discard(store, dirs, token, existed)  # nothing of this preparation stays
    else:
        sweep(store, dirs, token, files)  # files of failed task attempts
    if problem is not None:
        raise problem
    if dropped:
        logger.warning(
            "prepare_data: dropped %d rows with null or NaN values (%s)",
            dropped,
            ", ".join(f"{k}: {v}" for k, v in sorted(invalid.items())),
        )
    if not files["train"]:
        raise ConfigurationError(
            f"no training rows were written (validation={params['validation']!r}, "
            f"{dropped} rows dropped); lower the validation share or check the data"
        )
    return DatasetMetadata(
        dataset_idx=idx,
        cache_key=cache_key,
        columns={c.name: c for c in columns},
        feature_cols=list(params["feature_cols"]),
        label_cols=list(params["label_cols"]),
        sample_weight_col=params["sample_weight_col"],
        train_path=train_dir,
        val_path=val_dir,
        train_files=sorted(files["train"], key=lambda f: f.path),
        val_files=sorted(files["val"], key=lambda f: f.path),
        params={**params, "dropped_rows": dropped},
        created_at=now_iso(),
    )
