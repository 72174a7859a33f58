"""prepare_data: turn a Spark DataFrame into Parquet training data in a Store, once.

How it works
------------
1. Checks in the driver, before any job: columns exist (the message lists the available ones),
   types are supported (strings must be indexed first), ``validation`` is a fraction in [0, 1) or a
   bool/numeric column.
2. Cache key = the analyzed plan's semantic hash (for plans through ML transformers, whose
   ScalaUDFs hash by closure identity, a fingerprint of the plan's content instead:
   :mod:`spark_estimators.data.cache_key`) + ``df.inputFiles()`` with sizes and modification
   times + the preparation params that change the content (columns, validation, seed,
   ``compress_sparse``, ``drop_invalid_rows``) + the store paths. The dataset index is the key's
   first 16 hex digits. If ``{train}.{idx}.metadata.json`` exists, nothing is written and its
   metadata is returned; a new driver process finds it the same way. ``num_proc`` and
   ``partitions_per_process`` only change the file layout, not the content, and the readers
   balance rows exactly for any number of ranks, so they are not part of the key (except for a
   write without a shuffle, 4).
3. Shapes: scalars and ML vectors whose column metadata gives their size (VectorAssembler's
   ``ml_attr``) need no data. Otherwise one small job reads a few rows (shapes of arrays/vectors,
   sparse or dense, an empty DataFrame). So a DataFrame of such columns costs exactly the jobs of
   ``df.repartition(n).write.parquet`` (AQE's shuffle-map job and the write job).
4. One write job: ``repartition(num_proc * partitions_per_process, xxhash64(columns))``, then
   ``vector_to_array`` for dense ML vectors in the JVM, then ``mapInArrow`` writes Parquet **from
   the executors through the store's own pyarrow/fsspec filesystem**. This is the decision on
   writes: it needs no Hadoop connector jar (``s3a://`` is not in the pyspark wheel), the same code
   path serves local, S3, GCS, Azure, HDFS and DBFS and is testable end to end against an S3
   server, there is no ``_temporary`` rename (slow on object stores), and the tasks return exact
   row counts and row-group sizes, so no listing or footer read follows. Nulls/NaNs and wrong
   lengths are counted in the same pass; the driver raises a clear error (or the rows are dropped
   with ``drop_invalid_rows=True``). The shuffle mixes the rows of every input partition into every
   output partition (a sorted or grouped DataFrame does not give a rank one class), and
   ``coalesce`` would not. It hashes the rows' content instead of dealing them round-robin: Spark
   sorts every partition before a round-robin shuffle (so that a retried task sends the same rows
   to the same place), and a hash shuffle is as deterministic without that sort (~0.8 s of a 1M x
   32 write here). The partitions then differ by about the square root of their rows, which costs
   nothing: the readers cut equal shares for every rank out of all files (``data/shards.py``).
   **No shuffle** when none is needed to mix the rows: a DataFrame whose partitions no shuffle
   decides (a classic session's plan without an ``Exchange``: a range, a file scan, a cache of
   one; :func:`unshuffled_partitions`) and that has no more partitions than the write would
   make is written as it is partitioned, and each task deals every Arrow batch it receives into
   ``num_proc`` contiguous slices, slice ``k`` into files named ``s{k}-part-...``. The readers
   cut the ranks' shares in file-name order, so rank ``k`` reads about slice ``k`` of every
   input partition: rows of every input partition reach every rank, as with the shuffle (a
   sorted DataFrame does not give a rank one class), within ~5,000 rows (half an Arrow batch)
   instead of row by row. The shuffle was about half of the write (2 us of ~4 us a row at 1M x
   32 here: bench/RESULTS.md, issue 45). Such a layout mixes rows for ``num_proc`` ranks only,
   so its cache key adds ``num_proc`` (a fit with another ``num_proc`` prepares again).
5. The metadata is written last and atomically: its presence means the dataset is complete.
   Concurrent preparations of different data get different indexes; two processes preparing the
   same data write distinct file names, the first to publish wins and the other removes its files.
   A preparation that fails (null or NaN values, rows of another length, a failed, cancelled or
   interrupted write job) removes the files it wrote and the directories it created, so nothing
   of it stays in the store (a directory another process is writing into is kept).

``partitions_per_process`` default (None = automatic): enough partitions that each holds about
64 MiB by Spark's size estimate of the plan (1 to 32 per process), or 4 per process when Spark has
no estimate. Writers also start a new file past 128 MiB. Files of tens of MB keep the fixed cost
per file (open, footer, an object-store request of tens of ms) to a few percent of reading it, and
still give every rank several row groups to shuffle; many more, smaller files only add requests.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from spark_estimators.data._writer import INFO_SCHEMA, PartitionWriter
from spark_estimators.data.cache_key import compute_cache_key
from spark_estimators.data.columns import (
    SPLIT_COL,
    VECTOR_DTYPE,
    check_args,
    describe_columns,
    kind_of,
    plain_partitions,
    training_frame,
)
from spark_estimators.data.metadata import ColumnInfo, DatasetMetadata
from spark_estimators.data.publication import discard, load_complete, publish, written_dataset
from spark_estimators.errors import StoreError
from spark_estimators.store.base import StoreBase

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

logger = logging.getLogger(__name__)

TARGET_PARTITION_BYTES = 64 << 20
MAX_FILE_BYTES = 128 << 20
ROW_GROUP_BYTES = 8 << 20
DEFAULT_PARTITIONS_PER_PROCESS = 4
MAX_AUTO_PARTITIONS_PER_PROCESS = 32

_locks_guard = threading.Lock()
_locks: dict[str, threading.Lock] = {}


def prepare_data(
    num_proc: int,
    store: StoreBase,
    df: DataFrame,
    feature_cols: Sequence[str] | str,
    label_cols: Sequence[str] | str | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    partitions_per_process: int | None = None,
    verbose: int = 1,
    *,
    seed: int = 42,
    drop_invalid_rows: bool = False,
    check_columns: Callable[[dict[str, ColumnInfo]], None] | None = None,
    rank_imports: Sequence[str] = (),
) -> DatasetMetadata:
    """Write train/validation Parquet for ``df`` into ``store`` (or reuse it) and describe it.

    Parameters
    ----------
    num_proc
        Number of training processes; the data is repartitioned to a multiple of it.
    store
        Where the data goes (:class:`~spark_estimators.store.Store`).
    df
        The Spark DataFrame.
    feature_cols, label_cols
        Columns to keep: numbers, booleans, arrays of numbers, ML vectors (Dense or Sparse).
    validation
        ``None``/``0`` (none), a fraction in (0, 1) split at random with ``seed``, or the name of a
        bool or numeric column whose true/> 0 rows become validation rows (it is not stored).
    sample_weight_col
        Optional per-row weight column (numeric).
    compress_sparse
        Store vector columns that are mostly SparseVectors (in the first rows) as
        ``(indices, values)``; the reader re-densifies them.
    partitions_per_process
        Spark partitions (and at least as many files) per process; None chooses (module docs).
    verbose
        1 logs a summary at INFO, 2 also the details at INFO, 0 only at DEBUG.
    seed
        Seed of the random validation split.
    drop_invalid_rows
        Drop rows with a null or NaN in a used column instead of raising.
    check_columns
        Called with the columns' descriptions (shapes, dtypes) before anything is written, and
        for a reused dataset; raising there stops the preparation (estimators check
        ``input_shapes`` this way).
    rank_imports
        Modules the training ranks will import (the estimators pass ``("torch",)``): each write
        task starts its PySpark worker's zygote importing them while the data is
        written (:mod:`spark_estimators.task.spare`); () starts none.

    Returns
    -------
    DatasetMetadata
        Also a context manager (leaving it keeps the data), like horovod's ``prepare_data``.

    Examples
    --------
    >>> with prepare_data(2, store, df, ["features"], ["label"], validation=0.1) as meta:
    ...     meta.train_rows, meta.shapes["features"]  # doctest: +SKIP
    """
    from spark_estimators._base.session import ensure_driver_side

    ensure_driver_side("prepare_data")
    plan = check_args(
        num_proc,
        store,
        df,
        feature_cols,
        label_cols,
        validation,
        sample_weight_col,
        partitions_per_process,
    )
    features, labels, validation_col, fraction = plan
    used = features + labels + ([sample_weight_col] if sample_weight_col else [])
    kinds = {name: kind_of(df, name) for name in used}
    params = content_params(
        features, labels, sample_weight_col, validation, seed if fraction else None
    )
    params.update(compress_sparse=bool(compress_sparse), drop_invalid_rows=bool(drop_invalid_rows))
    cache_key, unshuffled = dataset_key(df, num_proc, store, params, partitions_per_process)
    idx = cache_key[:16]
    log = logger.info if verbose else logger.debug
    with _lock_for(idx):
        cached = load_complete(store, idx, cache_key)
        if cached is not None:
            if check_columns is not None:
                check_columns(dict(cached.columns))
            log(
                "prepare_data: reusing dataset %s (%d train rows, %d val rows)",
                idx,
                cached.train_rows,
                cached.val_rows,
            )
            return cached
        # Shapes from the schema when it has them: no sample job before the write (the write
        # finds an empty DataFrame itself); else from the first rows.
        columns = describe_columns(df, used, kinds, compress_sparse, check_columns)
        store.check_writable()
        if unshuffled is not None:
            partitions = unshuffled
        else:
            partitions = num_proc * (
                partitions_per_process or auto_partitions_per_process(df, num_proc)
            )
        meta = _write(
            store,
            df,
            idx,
            cache_key,
            columns,
            params,
            validation_col,
            fraction,
            seed,
            None if unshuffled is not None else partitions,
            drop_invalid_rows,
            tuple(rank_imports),
            slices=num_proc if unshuffled is not None else 1,
        )
        meta.params.update(num_proc=num_proc, partitions=partitions, shuffled=unshuffled is None)
        published = publish(store, meta)
    log(
        "prepare_data: dataset %s: %d train rows (%d files, %.1f MB), %d val rows in %s",
        idx,
        published.train_rows,
        len(published.train_files),
        published.train_bytes / 1e6,
        published.val_rows,
        store.get_train_data_path(idx),
    )
    if verbose >= 2:
        for col in published.columns.values():
            logger.info("  %s: %s %s shape=%s", col.name, col.kind, col.dtype, col.shape)
    return published


def content_params(
    features: list[str],
    labels: list[str],
    sample_weight_col: str | None,
    validation: float | str | None,
    seed: int | None,
) -> dict[str, object]:
    """The preparation params that change a dataset's rows (part of its cache key).

    ``compress_sparse`` and ``drop_invalid_rows`` are False here; ``prepare_data`` sets them.
    """
    return {
        "feature_cols": features,
        "label_cols": labels,
        "sample_weight_col": sample_weight_col,
        "validation": validation,
        "seed": seed,
        "compress_sparse": False,
        "drop_invalid_rows": False,
        "vector_dtype": VECTOR_DTYPE,  # datasets of float64 vectors (before) are other datasets
    }


def dataset_key(
    df: DataFrame,
    num_proc: int,
    store: StoreBase,
    params: dict[str, object],
    partitions_per_process: int | None = None,
) -> tuple[str, int | None]:
    """``prepare_data``'s cache key of ``df`` and its unshuffled partition count (or None).

    A write without a shuffle mixes rows for ``num_proc`` ranks only: its key adds ``num_proc``
    (module docs, 4). ``data="parquet+stream"`` publishes its copy under the same key, so a
    later ``prepare_data`` of the same DataFrame and params finds it.
    """
    unshuffled = unshuffled_partitions(df, num_proc, partitions_per_process)
    cache_key = compute_cache_key(df, params, store)
    if unshuffled is not None:  # the layout mixes rows for num_proc ranks only: its own key
        cache_key = hashlib.sha256(f"{cache_key}:slices={num_proc}".encode()).hexdigest()
    return cache_key, unshuffled


def _lock_for(idx: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(idx, threading.Lock())


# ------------------------------------------------------------------------ shapes and write
def auto_partitions_per_process(df: DataFrame, num_proc: int) -> int:
    """Partitions per process so each holds about 64 MiB by Spark's estimate (see module docs)."""
    try:
        # A scala BigInt; py4j answers it as a Python int (``.longValue()`` on it failed, so
        # every classic session got the no-estimate default).
        estimate = df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()
        size = int(estimate if isinstance(estimate, int) else estimate.longValue())
    except Exception:  # no estimate (Spark Connect, or the plan has none)
        size = -1
    if size <= 0 or size >= (1 << 50):  # Spark reports Long.MaxValue when it does not know
        return DEFAULT_PARTITIONS_PER_PROCESS
    wanted = math.ceil(size / (num_proc * TARGET_PARTITION_BYTES))
    return max(1, min(MAX_AUTO_PARTITIONS_PER_PROCESS, wanted))


def unshuffled_partitions(df: DataFrame, num_proc: int, ppp: int | None) -> int | None:
    """``df``'s partition count when the write can skip the shuffle (module docs, 4), else None.

    When no shuffle decides ``df``'s partitions (:func:`~.columns.plain_partitions`) and they
    are no more than the repartition would make: ``partitions_per_process`` of them when it is
    given, else at most max(the automatic count, 4) per process (each is written as
    ``num_proc`` slices, so that many files per process at most).
    """
    parts = plain_partitions(df)
    if parts is None or parts < 1:
        return None
    if ppp is not None:
        return parts if parts == ppp else None
    limit = max(auto_partitions_per_process(df, num_proc), DEFAULT_PARTITIONS_PER_PROCESS)
    return parts if parts <= limit else None


def _write(
    store: StoreBase,
    df: DataFrame,
    idx: str,
    cache_key: str,
    columns: list[ColumnInfo],
    params: dict[str, object],
    validation_col: str | None,
    fraction: float,
    seed: int,
    partitions: int | None,
    drop_invalid: bool,
    rank_imports: tuple[str, ...] = (),
    *,
    slices: int = 1,
) -> DatasetMetadata:
    frame, has_split = training_frame(
        df, columns, validation_col, fraction, seed, partitions, by_content=True
    )
    token = uuid.uuid4().hex[:10]
    train_dir = store.get_train_data_path(idx)
    val_dir = store.get_val_data_path(idx) if has_split else None
    writer = PartitionWriter(
        spec=store.filesystem_spec,
        train_dir=train_dir,
        val_dir=val_dir,
        token=token,
        columns=tuple(columns),
        split_col=SPLIT_COL if has_split else None,
        drop_invalid=drop_invalid,
        row_group_bytes=ROW_GROUP_BYTES,
        max_file_bytes=MAX_FILE_BYTES,
        rank_imports=rank_imports,
        slices=slices,
    )
    dirs = [d for d in (train_dir, val_dir) if d]
    existed = {d for d in dirs if store.exists(d)}
    try:
        rows = frame.mapInArrow(writer, INFO_SCHEMA).collect()
    except BaseException as exc:  # a failed task, a cancelled job, an interrupt in a notebook
        discard(store, dirs, token, existed)
        store_error = _executor_store_error(exc) if isinstance(exc, Exception) else None
        if store_error is None:
            raise
        raise StoreError(f"{store_error} (on an executor, in {store!r})") from exc
    lines = [r[0] for r in rows]
    return written_dataset(
        store, idx, cache_key, columns, params, lines, token, dirs, existed, drop_invalid
    )


def _executor_store_error(exc: BaseException) -> str | None:
    """The StoreError message a writer task raised, found in Spark's wrapped error, or None."""
    marker = "StoreError: "
    for line in reversed(str(exc).splitlines()):
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return None
