"""``data="parquet+stream"``, driver side: train from the stream, keep the Parquet copy.

A fit with ``data="parquet+stream"`` trains as ``data="stream"`` does (the barrier tasks spill
their partitions for their ranks, training starts on the first segments) and its tasks also
write the rows with ``prepare_data``'s writer into the store (:mod:`spark_estimators.task.
stream_spill`), so the write overlaps the training instead of preceding it. Once every rank and
task has succeeded, the driver publishes the dataset's metadata under **the cache key
``prepare_data`` computes for the same DataFrame and params** (:func:`~spark_estimators.data.
prepare.dataset_key`): a later ``data="parquet"`` fit (or ``"parquet+stream"``) of it runs no
write job and reads these files. The content is what ``prepare_data`` writes: the same rows, the
same validation split (``rand(seed)`` before the repartition, or the column), no sparse
compression, no dropped rows. The layout differs but the readers accept it: one partition per
rank (a round-robin share, or the DataFrame's own partition when the stream keeps them, then
written in ``num_proc`` slices as ``prepare_data``'s unshuffled layout is, so a later fit gives
every rank rows of every partition). Under the unshuffled key (``num_proc`` is part of it) the
files are what that key promises; under the shuffled key any ``num_proc`` reads them, the
readers cutting equal shares.

A fit finds the dataset already published: it trains on it as ``data="parquet"`` would (nothing
to write). A fit whose rank or task fails publishes nothing and deletes what its tasks wrote
(files of a task killed outright may stay, under a name no reader picks up, as with
``prepare_data``). A store error in a task, or rows the Parquet path refuses (the ranks saw
them only if they read that far), end the copy, not the fit: the driver logs why at WARNING.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spark_estimators.data._writer import PartitionWriter
from spark_estimators.data.columns import SPLIT_COL
from spark_estimators.data.metadata import ColumnInfo, DatasetMetadata
from spark_estimators.data.prepare import (
    MAX_FILE_BYTES,
    ROW_GROUP_BYTES,
    content_params,
    dataset_key,
)
from spark_estimators.data.publication import discard, load_complete, publish, written_dataset
from spark_estimators.errors import ConfigurationError, StoreError
from spark_estimators.store.base import StoreBase

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

logger = logging.getLogger(__name__)


@dataclass
class StreamCopy:
    """The Parquet copy a streamed fit's tasks write (driver only): publish or discard it."""

    store: StoreBase
    idx: str
    cache_key: str
    columns: list[ColumnInfo]
    params: dict[str, object]
    writer: PartitionWriter
    dirs: list[str]
    existed: set[str]
    #: What the metadata's params add to the content params (layout, provenance).
    params_extra: dict[str, object] = field(default_factory=dict)

    def publish(self, reports: list[str]) -> DatasetMetadata | None:
        """Every rank and task succeeded: publish what the tasks wrote (or log why not)."""
        lines: list[str] = []
        errors = []
        for report in reports:
            d = json.loads(report) if report else {"error": "a task sent no report"}
            if "error" in d:
                errors.append(d["error"])
            else:
                lines.extend(d["lines"])
        if errors:
            self.discard()
            logger.warning("the Parquet copy of this fit was not kept: %s", errors[0])
            return None
        try:
            meta = written_dataset(
                self.store,
                self.idx,
                self.cache_key,
                self.columns,
                self.params,
                lines,
                self.writer.token,
                self.dirs,
                self.existed,
                False,
            )
            meta.params.update(self.params_extra)
            published = publish(self.store, meta)
        except (ConfigurationError, StoreError, OSError) as exc:
            # rows prepare_data refuses, or a store error: the fit itself succeeded
            logger.warning("the Parquet copy of this fit was not kept: %s", exc)
            self.discard()
            return None
        logger.info(
            "data='parquet+stream': dataset %s kept (%d train rows, %d val rows) in %s",
            self.idx,
            published.train_rows,
            published.val_rows,
            self.dirs[0],
        )
        return published

    def discard(self) -> None:
        """The fit failed: remove every file its tasks wrote (and directories they created)."""
        discard(self.store, self.dirs, self.writer.token, self.existed)


def copy_key(
    num_proc: int,
    store: StoreBase,
    df: DataFrame,
    feature_cols: list[str],
    label_cols: list[str],
    validation: float | str | None,
    sample_weight_col: str | None,
    seed: int = 42,
) -> tuple[str, dict[str, object], bool]:
    """``prepare_data``'s cache key for these params, the content params, whether unshuffled.

    No job runs: the arguments are checked as ``prepare_data`` checks them (schema only).
    """
    from spark_estimators.data.columns import check_args

    features, labels, _, fraction = check_args(
        num_proc, store, df, feature_cols, label_cols, validation, sample_weight_col, None
    )
    seed_used = seed if fraction else None
    params = content_params(features, labels, sample_weight_col, validation, seed_used)
    cache_key, unshuffled = dataset_key(df, num_proc, store, params)
    return cache_key, params, unshuffled is not None


def published_copy(store: StoreBase, cache_key: str) -> DatasetMetadata | None:
    """The dataset published under ``cache_key`` (by ``prepare_data`` or a streamed fit)."""
    return load_complete(store, cache_key[:16], cache_key)


def plan_stream_copy(
    num_proc: int,
    store: StoreBase,
    columns: list[ColumnInfo],
    has_val: bool,
    key: tuple[str, dict[str, object], bool],
    kept_partitions: bool,
) -> StreamCopy:
    """The copy the tasks of a ``data="parquet+stream"`` fit write (driver; no job).

    ``columns`` and ``has_val`` are :func:`~spark_estimators.data.stream.prepare_stream`'s
    description of the DataFrame (its stream metadata), ``key`` its :func:`copy_key`;
    ``kept_partitions``: the stream keeps the DataFrame's partitions (no round-robin), so each
    task writes its partition in ``num_proc`` slices (module docs).
    """
    cache_key, params, unshuffled = key
    idx = cache_key[:16]
    train_dir = store.get_train_data_path(idx)
    val_dir = store.get_val_data_path(idx) if has_val else None
    dirs = [d for d in (train_dir, val_dir) if d]
    slices = num_proc if kept_partitions else 1
    writer = PartitionWriter(
        spec=store.filesystem_spec,
        train_dir=train_dir,
        val_dir=val_dir,
        token=uuid.uuid4().hex[:10],
        columns=tuple(columns),
        split_col=SPLIT_COL if has_val else None,
        drop_invalid=False,
        row_group_bytes=ROW_GROUP_BYTES,
        max_file_bytes=MAX_FILE_BYTES,
        slices=slices,
    )
    return StreamCopy(
        store=store,
        idx=idx,
        cache_key=cache_key,
        columns=list(columns),
        params=params,
        writer=writer,
        dirs=dirs,
        existed={d for d in dirs if store.exists(d)},
        params_extra={
            "num_proc": num_proc,
            "partitions": num_proc,
            "shuffled": not unshuffled,
            "written_while_training": True,
        },
    )
