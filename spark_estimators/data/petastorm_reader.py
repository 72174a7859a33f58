"""Optional petastorm reader (``make_batch_reader(..., reader="petastorm")``).

For environments that already have petastorm. petastorm 0.13.1 runs only with pyarrow 14,
pyspark <= 4.0.x and numpy < 2 (measured), so it is not a dependency of this package: see
``requirements-petastorm.txt`` for the pinned environment it is tested in. The wrapper keeps the
contract of :class:`~spark_estimators.data.reader.BatchReader`: every rank yields
``steps_per_epoch`` full batches (petastorm reads its row-group shard in an endless loop and we stop
after the last step), columns come out shaped per the metadata. Sparse vector columns are not
supported here (use the default reader). What each horovod setting does with this reader is in
:class:`PetastormBatchReader` and docs/store_and_data.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_estimators.data._epochs import EpochReader
from spark_estimators.data._pipeline import Batch, concat, rows_of, take
from spark_estimators.data.metadata import DatasetMetadata
from spark_estimators.data.options import TransformFn
from spark_estimators.data.shards import rank_and_size, steps_per_epoch
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    from spark_estimators.store.base import StoreBase


def _import_petastorm() -> Any:
    # petastorm 0.13.1 calls pyarrow 14's deprecated legacy dataset API on every read: one
    # FutureWarning per file and worker in the rank's output, none of them actionable here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
    try:
        import petastorm
    except ImportError as exc:
        raise ConfigurationError(
            "reader='petastorm' needs petastorm, which is not installed; it only works with "
            "pyarrow 14 / pyspark 4.0.x / numpy<2: pip install -r requirements-petastorm.txt && "
            "pip install --no-deps petastorm==0.13.1 (or use the default reader='arrow')"
        ) from exc
    return petastorm


POOL_TYPES = ("thread", "process", "dummy")


class PetastormBatchReader(EpochReader):
    """petastorm's ``make_batch_reader`` rebatched to full batches and equal steps per rank.

    The horovod settings that belong to petastorm mean what horovod documents:

    - ``transformation_fn`` runs inside petastorm as a ``TransformSpec`` (a pandas DataFrame in
      and out, on petastorm's workers); with ``transform_edit_fields`` /
      ``transform_removed_fields`` (horovod's ``transformation_edit_fields`` /
      ``transformation_removed_fields``) it may add, change or drop columns, as petastorm requires.
    - ``pool_type`` (horovod's ``reader_pool_type``): petastorm's ``'thread'``, ``'process'`` or
      ``'dummy'`` pool, with ``num_workers`` workers. An epoch is the next ``steps_per_epoch``
      batches of an endless stream over the rank's shard (as in horovod): the thread and process
      pools may return a row group late, so it can fall into the next epoch; the dummy pool
      (no workers) reads in order and every epoch reads every row of the shard.
    - ``shuffle_buffer_size``: rows permuted together after petastorm's row-group shuffle
      (horovod's shuffling queue); ``None`` or 0 as the default reader.
    - ``inmemory_cache``: the first epoch reads the shard once, exactly (the dummy pool), and
      keeps it; every epoch is a seeded permutation of the cached rows, each row at least once
      (horovod's in-memory loader).
    """

    def __init__(
        self,
        store: StoreBase,
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
        num_workers: int = 1,
        pool_type: str = "thread",
        transform_edit_fields: Sequence[Any] | None = None,
        transform_removed_fields: Sequence[str] | None = None,
    ) -> None:
        _import_petastorm()
        self.rank, self.size = rank_and_size(rank, size)
        self._init_epochs(split, batch_size, shuffle, seed, epoch)
        self.store = store
        self.metadata = metadata
        self.num_workers = num_workers
        self.transformation_fn = transformation_fn
        self.edit_fields = list(transform_edit_fields or [])
        self.removed_fields = list(transform_removed_fields or [])
        if pool_type not in POOL_TYPES:
            raise ConfigurationError(
                f"reader_pool_type={pool_type!r} is invalid: expected one of {POOL_TYPES!r}"
            )
        self.pool_type = pool_type
        names = (
            list(columns)
            if columns is not None
            else (
                metadata.feature_cols
                + metadata.label_cols
                + ([metadata.sample_weight_col] if metadata.sample_weight_col else [])
            )
        )
        # Read what exists in the files; columns a TransformSpec adds come out of the transform.
        self.columns = {c: metadata.columns[c] for c in names if c in metadata.columns}
        added = [f[0] for f in self.edit_fields if f[0] not in self.columns]
        missing = [c for c in names if c not in self.columns and c not in added]
        if missing:
            raise ConfigurationError(
                f"column(s) {missing!r} are neither in the dataset nor added by "
                "transformation_edit_fields"
            )
        self.out_names = [c for c in names if c not in self.removed_fields]
        sparse = [c for c, info in self.columns.items() if info.is_sparse]
        if sparse or stack_columns:
            raise ConfigurationError(
                f"reader='petastorm' does not support sparse columns {sparse!r} or "
                "stack_columns; use reader='arrow'"
            )
        files = metadata.files(split)
        self.urls = [store.full_path(f.path) for f in files]
        shard_rows = _row_group_shards([rows for f in files for rows in f.row_groups], self.size)
        self.shard_rows = shard_rows[self.rank]
        # petastorm shards by row group (global index % ranks), so shards can differ by whole
        # row groups: the steps come from the largest, and shorter shards wrap around.
        self.steps_per_epoch = steps_per_epoch(max(shard_rows), 1, batch_size)
        self.buffer_rows = _buffer_rows(shuffle_buffer_size, batch_size, self.steps_per_epoch)
        self.inmemory_cache = inmemory_cache
        self._cache: Batch | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def peek(self) -> Batch:
        """The first ``batch_size`` rows of this rank's shard (no shuffle; fewer if it is short).

        What the estimators' ranks look at to learn the model's output shapes; read in this
        thread (petastorm's dummy pool), in order.
        """
        parts: list[Batch] = []
        with self._open(0, num_epochs=1, pool_type="dummy", shuffle=False) as reader:
            for block in self._blocks(reader):
                parts.append(block)
                if sum(rows_of(p) for p in parts) >= self.batch_size:
                    break
        return take(_joined(parts), 0, self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._next_epoch()
        if self.inmemory_cache:
            yield from self._cached_epoch(epoch)
        else:
            yield from self._rebatch(self._passes(epoch), epoch)

    # -- petastorm ------------------------------------------------------------------------------
    def _passes(self, epoch: int) -> Iterator[Batch | None]:
        """The epoch's blocks from an endless petastorm reader; ``None`` after each pass's rows.

        An endless reader because with ``num_epochs=1`` petastorm 0.13.1's thread pool sometimes
        ends the stream before its last row groups (measured here: about 1 pass in 5 short by one
        or two row groups). The endless stream loses nothing, but its pools may return a row
        group later than it was sent out, so a pass's ``shard_rows`` rows are one pass over the
        shard only approximately; the dummy pool (in this thread) is exact.
        """
        seen = 0
        with self._open(epoch, num_epochs=None, pool_type=self.pool_type) as reader:
            for block in self._blocks(reader):
                yield block
                seen += rows_of(block)
                if seen >= self.shard_rows:
                    seen -= self.shard_rows
                    yield None  # the end of a pass

    def _open(
        self, epoch: int, num_epochs: int | None, pool_type: str, shuffle: bool | None = None
    ) -> Any:
        from petastorm import make_batch_reader as petastorm_reader

        urls = [u if "://" in u else "file://" + u for u in self.urls]
        transform = None
        if self.transformation_fn is not None:
            from petastorm import TransformSpec

            transform = TransformSpec(
                self.transformation_fn,
                edit_fields=[tuple(f) for f in self.edit_fields] or None,
                removed_fields=self.removed_fields or None,
            )
        return petastorm_reader(
            urls,
            schema_fields=list(self.columns),
            cur_shard=self.rank,
            shard_count=self.size,
            shuffle_row_groups=self.shuffle if shuffle is None else shuffle,
            seed=self.seed + epoch,
            num_epochs=num_epochs,
            reader_pool_type=pool_type,
            workers_count=self.num_workers,
            transform_spec=transform,
            storage_options=getattr(self.store, "storage_options", None),
        )

    def _blocks(self, reader: Any) -> Iterator[Batch]:
        for group in reader:
            yield {name: self._column(getattr(group, name), name) for name in self.out_names}

    # -- batches --------------------------------------------------------------------------------
    def _rebatch(self, blocks: Iterator[Batch | None], epoch: int) -> Iterator[Batch]:
        """``steps_per_epoch`` full batches from ``blocks``, shuffled inside ``buffer_rows``.

        ``None`` in ``blocks`` ends a pass over the shard: what is held is flushed then, so rows
        of the next pass (the wrap-around of a short shard) never push rows of this pass out of
        the epoch. Rows left over after the full batches (fewer than a batch) go first into the
        next batch.
        """
        bs = self.batch_size
        rng = self._rng(epoch)
        shuffle = self.shuffle and self.buffer_rows > 1
        target = max(self.buffer_rows, bs) if shuffle else bs
        carry: Batch | None = None
        pending: list[Batch] = []
        held = 0
        emitted = 0
        for block in blocks:
            if block is not None:
                pending.append(block)
                held += rows_of(block)
                if held < target:
                    continue
            if not pending:
                continue
            fresh = _joined(pending)
            if shuffle:
                fresh = _gather(fresh, rng.permutation(held))
            pool = fresh if carry is None else _joined([carry, fresh])
            total = rows_of(pool)
            start = 0
            while start + bs <= total:
                yield take(pool, start, start + bs)
                emitted, start = emitted + 1, start + bs
                if emitted == self.steps_per_epoch:
                    return
            carry = take(pool, start, total) if start < total else None
            pending, held = [], 0

    def _cached_epoch(self, epoch: int) -> Iterator[Batch]:
        """An epoch from the rank's shard held in memory (read once, on the first epoch)."""
        if self._cache is None:
            # One exact pass: the dummy pool reads in this thread, in order, to the end.
            with self._open(epoch, num_epochs=1, pool_type="dummy") as reader:
                self._cache = _joined(list(self._blocks(reader)))
        rows = rows_of(self._cache)
        rng = self._rng(epoch)
        need = self.steps_per_epoch * self.batch_size
        # Every cached row once per pass; short shards wrap around to fill the last steps.
        passes = -(-need // rows)
        order = np.concatenate(
            [rng.permutation(rows) if self.shuffle else np.arange(rows) for _ in range(passes)]
        )[:need]
        for step in range(self.steps_per_epoch):
            yield _gather(self._cache, order[step * self.batch_size : (step + 1) * self.batch_size])

    def _column(self, values: Any, name: str) -> np.ndarray:
        if values.dtype == object:  # petastorm hands list columns over as arrays of arrays
            values = np.stack(values)
        info = self.columns.get(name)
        if info is None or self.transformation_fn is not None:
            return np.asarray(values)  # shaped by the transform (or added by it)
        return np.asarray(values, dtype=info.dtype).reshape((-1, *info.shape))


def _row_group_shards(group_rows: Sequence[int], size: int) -> list[int]:
    """Rows of each rank's shard: petastorm gives rank ``r`` the row groups ``i % size == r``."""
    if len(group_rows) < size:
        raise ConfigurationError(
            f"reader='petastorm' shards by row group, and the data has {len(group_rows)} row "
            f"group(s) for {size} ranks: write it in more files or row groups (e.g. "
            "partitions_per_process), or use reader='arrow', which shards by row"
        )
    return [sum(group_rows[rank::size]) for rank in range(size)]


def _buffer_rows(size: int | None, batch_size: int, steps: int) -> int:
    """Rows shuffled together; None or 0: ``min(shard rows, max(100000, 4 * batch_size))``."""
    if size:
        return int(size)
    return min(steps * batch_size, max(100_000, 4 * batch_size))


def _joined(blocks: Sequence[Batch]) -> Batch:
    """``concat`` without the copy when there is one block."""
    return blocks[0] if len(blocks) == 1 else concat(list(blocks))


def _gather(batch: Batch, index: np.ndarray) -> Batch:
    return {k: np.take(v, index, axis=0) for k, v in batch.items()}
