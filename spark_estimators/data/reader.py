"""Executor-side readers: prepared Parquet -> batches of numpy arrays, equal steps on every rank.

:func:`make_batch_reader` is the entry point; :mod:`spark_estimators.data.adapters` turns its
batches into torch tensors or a ``tf.data.Dataset``.

Sharding and epochs
-------------------
The rows of a split (files in metadata order, row groups in file order) are cut into ``size``
contiguous ranges whose lengths differ by at most one row; rank ``r`` owns range ``r`` for every
epoch (so ``inmemory_cache`` holds one shard). Every rank yields the same number of full batches,
``steps_per_epoch = ceil(ceil(rows / size) / batch_size)``: a rank whose rows run out first wraps
around its own rows (in a new order) to fill its last steps, so no rank leaves a collective
(allreduce) early and hangs the others (without shuffling, that pass decodes only the rows it
needs). Each row is read at least once per epoch; extra reads over
all ranks are fewer than ``size * batch_size``, and none when ``rows`` is a multiple of
``size * batch_size``.

Shuffling (``shuffle=True``) is seeded by ``(seed, epoch, rank, pass)``: the order of the shard's
row-group slices is permuted, then rows are permuted inside a buffer of ``shuffle_buffer_size``
rows.

Pipeline (issue 20: at the speed of a raw pyarrow scan, memory flat in the data size):

- ``num_workers`` threads each stream one row-group slice with ``ParquetFile.iter_batches`` in
  blocks of about ``BLOCK_BYTES`` (1 MB) through a 1 MB read buffer, one block queued ahead
  (Arrow decodes without the GIL); the slices come out strictly in order
  (:mod:`spark_estimators.data._scan`). The ``pyarrow.dataset`` scanner used before decoded whole
  row groups with their compressed bytes alongside: memory followed the row-group size.
- A background thread decodes blocks to numpy with vectorised conversions (lists become ``[n, k]``
  arrays, sparse vectors are scattered into dense arrays; Arrow's freshly decoded buffers are
  handed out as writable arrays without a copy), applies ``transformation_fn``, shuffles (rows
  copied into one reused buffer of ``shuffle_buffer_size`` rows, permuted out in blocks with
  ``np.take``) and cuts the blocks into batches (``Tensor.split`` for torch); ``prefetch`` groups
  of batches wait in a queue, and the training thread only takes them out.
- Rows held at once are bounded whatever the data size: the shuffle buffer plus
  ``(prefetch + 2) * (block_rows + batch_size)`` rows (``BatchReader.held_rows_peak`` reports the
  high-water mark; the scan threads hold about ``2 * num_workers`` blocks more).

Batches are writable and never shared with the cache, so in-place changes to a batch are safe.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Unpack

import numpy as np

from spark_estimators import envvars
from spark_estimators.data._arrow import table_to_numpy
from spark_estimators.data._epochs import PipelineReader
from spark_estimators.data._pipeline import (
    NUMPY_BLOCKS,
    Batch,
    BlockFormat,
    HeldRows,
    concat,
    rows_of,
    take,
)
from spark_estimators.data._scan import OrderedScan, ScanPiece
from spark_estimators.data.metadata import ColumnInfo, DatasetMetadata
from spark_estimators.data.options import ReaderKeywords, ReaderOptions, TransformFn
from spark_estimators.data.shards import (
    RowSlice,
    plan_shard,
    rank_and_size,
    shard_bounds,
    steps_per_epoch,
)
from spark_estimators.errors import ConfigurationError, StoreError

DEFAULT_SHUFFLE_BUFFER_ROWS = 100_000
# ... and at most this many bytes of rows (wide rows: 100k images of 3x64x64 float32 are 4.9 GB).
DEFAULT_SHUFFLE_BUFFER_BYTES = 256 << 20
# Rows per decoded block: about this many bytes (at least one batch, unless a batch is larger than
# LARGE_BATCH_BYTES), so memory does not follow the row-group size (prepare_data writes ~8 MB row
# groups, other writers up to whole files).
BLOCK_BYTES = 1 << 20
# Batches larger than this are joined from blocks of about BLOCK_BYTES: Parquet decodes a
# list<float> column of 12288 values per row at 64-85 us/row in 1 MB blocks against 133-180 in
# 12 MB ones (one block per batch of 256), and the join costs less than the difference.
LARGE_BATCH_BYTES = 4 << 20

__all__ = [
    "NUMPY_BLOCKS",
    "BatchReader",
    "BlockFormat",
    "RowSlice",
    "make_batch_reader",
    "plan_shard",
    "shard_bounds",
    "steps_per_epoch",
]


class BatchReader(PipelineReader):
    """Iterates one epoch of equal-sized batches per ``iter()``; see the module docstring.

    Attributes
    ----------
    steps_per_epoch
        Batches per epoch, the same on every rank.
    epoch
        The epoch the next ``iter()`` runs (it advances by one each time).
    """

    def __init__(
        self,
        store: Any,
        metadata: DatasetMetadata,
        *,
        split: str = "train",
        rank: int | None = None,
        size: int | None = None,
        batch_size: int = 32,
        columns: Sequence[str] | None = None,
        shuffle: bool = True,
        seed: int | None = 0,
        epoch: int = 0,
        shuffle_buffer_size: int | None = None,
        inmemory_cache: bool = False,
        transformation_fn: TransformFn | None = None,
        stack_columns: Mapping[str, Sequence[str]] | None = None,
        prefetch: int = 2,
        num_workers: int = 2,
    ) -> None:
        self.rank, self.size = rank_and_size(rank, size)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size={batch_size!r} must be a positive integer")
        if num_workers < 1 or prefetch < 0:
            raise ConfigurationError(
                f"num_workers={num_workers!r} must be >= 1 and prefetch={prefetch!r} >= 0"
            )
        self._init_epochs(split, batch_size, shuffle, seed, epoch)
        self.store = store
        self.metadata = metadata
        self.inmemory_cache = inmemory_cache
        self.transformation_fn = transformation_fn
        self.prefetch = prefetch
        self.num_workers = num_workers
        self.stack_columns = {k: list(v) for k, v in (stack_columns or {}).items()}
        names = list(columns) if columns is not None else _default_columns(metadata)
        unknown = [c for c in names if c not in metadata.columns]
        unknown += [c for cols in self.stack_columns.values() for c in cols if c not in names]
        if unknown:
            raise ConfigurationError(
                f"columns {unknown!r} are not in the dataset; available: {list(metadata.columns)!r}"
            )
        self.columns: dict[str, ColumnInfo] = {c: metadata.columns[c] for c in names}
        files = metadata.files(split)
        self.total_rows = sum(f.rows for f in files)
        if self.total_rows < self.size:
            raise ConfigurationError(
                f"the {split} split has {self.total_rows} rows, fewer than the {self.size} ranks; "
                "every rank needs at least one row (use fewer processes or more data)"
            )
        self.slices = plan_shard(files, self.rank, self.size)
        self.shard_rows = sum(s.rows for s in self.slices)
        self.steps_per_epoch = steps_per_epoch(self.total_rows, self.size, batch_size)
        self.shuffle_buffer_size = shuffle_buffer_size or min(
            default_shuffle_rows(self.columns, batch_size), self.shard_rows
        )
        self._cache: dict[int, list[Batch]] = {}
        self._cached: set[int] = set()  # slices whose every block is in the cache
        self._init_pipeline()
        self.block_rows = _block_rows(self.columns, batch_size)
        self._file_metadata: dict[str, Any] = {}  # Parquet footers, read once per file
        self._group_rows = {f.path: f.row_groups for f in files}

    def __len__(self) -> int:
        return self.steps_per_epoch

    # ------------------------------------------------------------------ PipelineReader's hooks
    def _steps_now(self) -> int:
        return self.steps_per_epoch

    def _rows_needed(self, pass_over: bool) -> int:
        return self.steps_per_epoch * self.batch_size

    def _pass_chunks(
        self, rng: np.random.Generator, rows_left: int | None = None
    ) -> Generator[Batch, None, None]:
        order = np.arange(len(self.slices))
        if self.shuffle:
            rng.shuffle(order)
        slices = self.slices
        # The cache wants whole slices; transformation_fn may drop rows (then more are needed).
        if rows_left is not None and not self.inmemory_cache and self.transformation_fn is None:
            slices = _first_rows(slices, rows_left)
        return self._chunks(order[: len(slices)], slices)

    def _batch_groups(
        self, epoch: int, fmt: BlockFormat, held: HeldRows
    ) -> Generator[list[dict[str, Any]], None, int]:
        """Lists of full batches, ``steps_per_epoch`` batches in all, one list per block."""
        emitted = yield from super()._batch_groups(epoch, fmt, held)
        if emitted < self.steps_per_epoch:  # unreachable unless transformation_fn drops every row
            raise StoreError(
                f"rank {self.rank}: the {self.split} data ran out after {emitted} of "
                f"{self.steps_per_epoch} batches"
            )
        return emitted

    def _chunks(
        self, order: np.ndarray, slices: Sequence[RowSlice] | None = None
    ) -> Generator[Batch, None, None]:
        """Decoded blocks of ``slices`` (default: the shard's), in ``order``: cache or scan."""
        slices = self.slices if slices is None else slices
        if self.inmemory_cache and len(self._cached) == len(self.slices):
            for i in order:
                for chunk in self._cache[int(i)]:
                    # Batches are views of the block: never hand out the cached arrays themselves
                    # (the shuffle buffer copies them).
                    yield chunk if self.shuffle else {k: v.copy() for k, v in chunk.items()}
            return
        for pos, batch, last in self._scan([slices[int(i)] for i in order]):
            chunk = self._decode(batch)
            if self.inmemory_cache:
                i = int(order[pos])
                if i in self._cached:  # a slice read again after an interrupted pass
                    self._cached.discard(i)
                    self._cache[i] = []
                self._cache.setdefault(i, []).append(chunk)
                if last:
                    self._cached.add(i)
                if not self.shuffle:
                    chunk = {k: v.copy() for k, v in chunk.items()}
            yield chunk

    def _scan(self, pieces: list[RowSlice]) -> Generator[tuple[int, Any, bool], None, None]:
        """``(piece index, record batch, last of the piece)`` of the slices, in order.

        ``num_workers`` slices are decoded ahead at once on their own threads, in record batches
        of at most ``block_rows`` rows, so memory does not follow the row-group size (see
        :mod:`spark_estimators.data._scan`).
        """
        scan = OrderedScan(
            self.store.filesystem,
            [
                ScanPiece(
                    self.store.fs_path(p.path),
                    p.row_group,
                    p.start,
                    p.stop,
                    self._group_rows[p.path][p.row_group],
                )
                for p in pieces
            ],
            list(self.columns),
            self.block_rows,
            workers=self.num_workers,
            depth=_readahead_blocks(self.num_workers, -(-self.batch_size // self.block_rows)),
            metadata_cache=self._file_metadata,
        )
        batches = scan.batches()
        try:
            yield from batches
        finally:
            batches.close()

    def _decode(self, table: Any) -> Batch:
        # Arrow's decoded buffers are handed out without a copy when they are ours to change; when
        # shuffling, the buffer copies every row anyway, so a read-only view is fine there.
        arrays = table_to_numpy(table, self.columns, writable=not self.shuffle)
        if self.transformation_fn is not None:
            arrays = _apply_transformation(self.transformation_fn, arrays)
        for name, cols in self.stack_columns.items():
            parts = [arrays.pop(c) for c in cols]
            arrays[name] = np.column_stack(parts)
        return arrays

    def peek(self) -> Batch:
        """The first ``batch_size`` rows of this rank's shard, decoded (no shuffle, no wrap)."""
        scan = self._scan(self.slices[:1])
        parts: list[Batch] = []
        try:
            for _, batch, _ in scan:
                parts.append(self._decode(batch))
                if sum(rows_of(p) for p in parts) >= self.batch_size:
                    break
        finally:
            scan.close()
        chunk = parts[0] if len(parts) == 1 else concat(parts)
        return take(chunk, 0, min(self.batch_size, rows_of(chunk)))


def make_batch_reader(
    store: Any,
    metadata: DatasetMetadata,
    options: ReaderOptions | None = None,
    *,
    split: str = "train",
    rank: int | None = None,
    size: int | None = None,
    **settings: Unpack[ReaderKeywords],
) -> Any:
    """A reader of one split for one rank; iterate it once per epoch.

    Parameters
    ----------
    store
        The store, or its ``to_remote()`` view (what executors and rank processes have).
    metadata
        From :func:`~spark_estimators.data.prepare_data` or :meth:`DatasetMetadata.load`.
    options
        The reader settings (:class:`~spark_estimators.data.ReaderOptions`; default
        ``ReaderOptions()``).
    split
        ``"train"`` or ``"val"``.
    rank, size
        This rank and the number of ranks; default to ``SPARK_ESTIMATORS_RANK`` / ``_SIZE``.
    **settings
        Any field of :class:`~spark_estimators.data.ReaderOptions` as a keyword (``batch_size=32,
        columns=None, shuffle=True, seed=0, epoch=0, shuffle_buffer_size=None,
        inmemory_cache=False, transformation_fn=None, stack_columns=None, prefetch=2,
        num_workers=2, reader="arrow"``); it overrides the same field of ``options``.

    Returns
    -------
    BatchReader
        ``steps_per_epoch``, ``len()``, ``set_epoch()``; ``iter()`` yields ``{column: ndarray}``.

    Examples
    --------
    >>> opts = ReaderOptions(batch_size=64, shuffle=False)  # doctest: +SKIP
    >>> reader = make_batch_reader(store, meta, opts, split="val", rank=0, size=2)  # doctest: +SKIP
    """
    if options is not None and not isinstance(options, ReaderOptions):
        raise ConfigurationError(
            f"options={options!r} must be a ReaderOptions (spark_estimators.data.ReaderOptions)"
        )
    opts = (options or ReaderOptions()).replace(**settings)
    kwargs = dict(split=split, rank=rank, size=size, **opts.reader_kwargs())
    if opts.reader == "arrow":
        return BatchReader(store, metadata, **kwargs)
    from spark_estimators.data.petastorm_reader import PetastormBatchReader

    return PetastormBatchReader(store, metadata, **kwargs)


# ---------------------------------------------------------------------------------- helpers
def _default_columns(metadata: DatasetMetadata) -> list[str]:
    cols = list(metadata.feature_cols) + list(metadata.label_cols)
    if metadata.sample_weight_col:
        cols.append(metadata.sample_weight_col)
    return cols or list(metadata.columns)


def _first_rows(slices: Sequence[RowSlice], rows: int) -> list[RowSlice]:
    """The slices that hold the first ``rows`` rows of ``slices``, the last one cut short.

    A wrap-around pass without shuffling (a shard of 1M rows and batches of 256 need 192 rows
    of a second pass) then decodes those rows, not whole row groups on every decode thread.
    """
    out: list[RowSlice] = []
    for s in slices:
        if rows <= 0:
            break
        out.append(s if s.rows <= rows else replace(s, stop=s.start + rows))
        rows -= s.rows
    return out


def _readahead_blocks(num_workers: int, blocks_per_batch: int = 1) -> int:
    """Blocks each decode thread keeps ready: 4 batches' worth when the rank has cores to spare.

    With several threads, the next slice's thread must run ahead while the current slice is
    consumed to decode in parallel at all: 1 MB ahead gave 0.63x a raw pyarrow scan on an idle
    2-core machine, 4 MB 0.99x (bench/data.py). When the ranks of a host already fill its cores
    (``SPARK_ESTIMATORS_LOCAL_SIZE``), read-ahead buys no speed, only memory. Blocks of wide rows
    are smaller than a batch (``blocks_per_batch`` > 1): the depth counts batches there, so a
    thread gets as far ahead in rows as with narrow rows.
    """
    ranks_here = max(envvars.env_int(envvars.SE_LOCAL_SIZE, 1), 1)
    spare_cores = (os.cpu_count() or 1) // ranks_here >= 2
    return (4 if num_workers > 1 and spare_cores else 1) * max(blocks_per_batch, 1)


def row_bytes(columns: Mapping[str, ColumnInfo]) -> int:
    """Bytes of one decoded row of ``columns``."""
    return sum(np.dtype(info.dtype).itemsize * max(info.size, 1) for info in columns.values())


def _block_rows(columns: Mapping[str, ColumnInfo], batch_size: int) -> int:
    width = max(row_bytes(columns), 1)
    rows = max(BLOCK_BYTES // width, 1)
    return rows if width * batch_size > LARGE_BATCH_BYTES else max(rows, batch_size)


def default_shuffle_rows(columns: Mapping[str, ColumnInfo], batch_size: int) -> int:
    """The shuffle buffer's rows by default: 100k, at most 256 MB of rows, at least 4 batches."""
    by_bytes = DEFAULT_SHUFFLE_BUFFER_BYTES // max(row_bytes(columns), 1)
    return max(min(DEFAULT_SHUFFLE_BUFFER_ROWS, by_bytes), 4 * batch_size)


def _apply_transformation(fn: TransformFn, arrays: Batch) -> Batch:
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in arrays.items()})
    result = fn(frame)
    if not isinstance(result, pd.DataFrame):
        raise ConfigurationError(
            f"transformation_fn must return a pandas DataFrame, got {type(result).__name__}"
        )
    out: Batch = {}
    for name in result.columns:
        col = result[name]
        if col.dtype == object and len(col) and isinstance(col.iloc[0], np.ndarray | list):
            out[str(name)] = np.stack([np.asarray(v) for v in col])
        else:
            out[str(name)] = np.ascontiguousarray(col.to_numpy())
    return out
