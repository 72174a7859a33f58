"""What the readers share: the epoch counter, seeded passes, wrap-around and batch cutting.

Every reader (the Parquet :class:`~spark_estimators.data.reader.BatchReader`, the data="stream"
:class:`~spark_estimators.data.stream_reader.StreamBatchReader` and the petastorm wrapper) counts
epochs the same way and seeds its shuffle by ``(seed, epoch, rank, pass)``: :class:`EpochReader`.

The two readers built on :mod:`spark_estimators.data._pipeline` also share how an epoch is made
(:class:`PipelineReader`): passes over the rank's rows (each pass in a new seeded order, through
the shuffle buffer) until the epoch's rows are out, so a rank whose rows run out first wraps around
its own rows; the blocks are cut into full batches, a batch spanning two blocks joined, in the
prefetch thread; the training thread only takes the groups of batches out. A reader supplies the
rows of one pass (:meth:`PipelineReader._pass_chunks`) and how many batches and rows an epoch
needs (:meth:`PipelineReader._steps_now`, :meth:`PipelineReader._rows_needed`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from spark_estimators.data._pipeline import (
    NUMPY_BLOCKS,
    Batch,
    BlockFormat,
    HeldRows,
    Prefetcher,
    ShuffleBuffer,
    concat,
    rows_of,
    split_batches,
    take,
)
from spark_estimators.data._staging import joiner, stage_block, staging_allocator
from spark_estimators.errors import StoreError


class EpochReader:
    """The settings every reader has and its epoch counter (``set_epoch``, the seeded rng)."""

    rank: int
    split: str
    batch_size: int
    shuffle: bool
    seed: int
    epoch: int

    def _init_epochs(
        self, split: str, batch_size: int, shuffle: bool, seed: int | None, epoch: int
    ) -> None:
        """Keep the settings shared by every reader (``seed=None`` means 0)."""
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (and so the shuffle order) of the next ``iter()``."""
        self.epoch = epoch

    def _next_epoch(self) -> int:
        """The epoch the next ``iter()`` runs; the counter moves on to the one after it."""
        epoch = self.epoch
        self.epoch += 1
        return epoch

    def _rng(self, epoch: int, *passes: int) -> np.random.Generator:
        """The generator seeded by ``(seed, epoch, rank, pass)`` (or without a pass number)."""
        return np.random.default_rng([self.seed, epoch, self.rank, *passes])


class PipelineReader(EpochReader):
    """An epoch of full batches from passes over the rank's rows (module docstring)."""

    shuffle_buffer_size: int
    block_rows: int
    prefetch: int

    def _init_pipeline(self) -> None:
        self._held = HeldRows()
        self._spare_buffer: Batch | None = None  # the shuffle buffer's arrays between passes

    # -------------------------------------------------------------------- what a reader gives
    def _pass_chunks(
        self, rng: np.random.Generator, rows_left: int | None = None
    ) -> Generator[Batch, None, None]:
        """Decoded blocks of one pass over the rank's rows, in an order drawn from ``rng``.

        ``rows_left``: when not None, the epoch takes at most that many rows of this pass (given
        only without shuffling, where they are the pass's first rows), so a reader may read no
        further than that.
        """
        raise NotImplementedError

    def _steps_now(self) -> int | None:
        """Batches in this epoch, or None while not known yet (the batches are cut meanwhile)."""
        raise NotImplementedError

    def _rows_needed(self, pass_over: bool) -> int | None:
        """Rows the epoch needs, once known: mid-pass (``pass_over=False``) or after a pass."""
        raise NotImplementedError

    # -------------------------------------------------------------------------- epochs
    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch()

    def iter_epoch(self, block_format: BlockFormat | None = None) -> Iterator[dict[str, Any]]:
        """Run the next epoch; ``block_format`` converts whole blocks (e.g. to torch) first.

        Converting once per decoded block in the background thread, rather than once per batch in
        the training thread, leaves the training thread only the slicing.
        """
        return self._batches(self._next_epoch(), block_format or NUMPY_BLOCKS)

    @property
    def held_rows_peak(self) -> int:
        """Most decoded rows held at once by the last epoch (shuffle buffer + queued batches).

        At most ``shuffle_buffer_size + (prefetch + 2) * (block_rows + batch_size)`` whatever the
        data size (a testing hook for that bound; ``inmemory_cache`` holds the shard on top).
        """
        return self._held.peak

    # ----------------------------------------------------------------------- consumer side
    def _batches(self, epoch: int, fmt: BlockFormat) -> Iterator[dict[str, Any]]:
        """The batches of one epoch: the background thread cuts them, this thread hands them out."""
        # Resolved here, on the training thread (its CUDA device), not in the prefetch thread.
        staging = staging_allocator(fmt.pin_memory, fmt.staging)
        fmt = replace(fmt, pin_memory=False, staging=staging)
        held = self._held = HeldRows()
        with Prefetcher(self._batch_groups(epoch, fmt, held), self.prefetch) as groups:
            for group in groups:
                yield from group
                held.consumed += len(group) * self.batch_size

    # ----------------------------------------------------------------------- producer side
    def _batch_groups(
        self, epoch: int, fmt: BlockFormat, held: HeldRows
    ) -> Generator[list[dict[str, Any]], None, int]:
        """Lists of full batches up to the epoch's count, one list per block; returns the count.

        A batch that spans several blocks (blocks of wide rows are smaller than a batch) is
        joined once from all its pieces. With a staging allocator (pinned memory for a GPU, see
        :mod:`spark_estimators.data._staging`) every row of a batch is copied into a staged
        buffer exactly once: by that join, or by one copy of the rows a block's batches take.
        """
        bs = self.batch_size
        emitted = 0
        pending: list[dict[str, Any]] = []  # pieces of the next batch, fewer than bs rows
        pending_rows = 0
        staging = staging_allocator(fmt.pin_memory, fmt.staging)
        join = joiner(staging, fmt.concat)
        blocks = self._blocks(epoch, held)
        try:
            for decoded in blocks:
                steps = self._steps_now()
                if steps is not None and emitted >= steps:
                    return emitted
                block = fmt.convert(decoded)
                n, start, group = rows_of(block), 0, []
                if pending:
                    need = bs - pending_rows
                    if n < need:
                        pending.append(block)
                        pending_rows += n
                        continue
                    group.append(concat([*pending, take(block, 0, need)], join))
                    start, pending, pending_rows = need, [], 0
                count = (n - start) // bs
                if steps is not None:
                    count = min(count, steps - emitted - len(group))
                if count > 0:
                    body = take(block, start, start + count * bs)
                    if staging is not None:
                        body = stage_block(body, staging)
                    group += split_batches(body, 0, count, bs)
                start += max(count, 0) * bs
                emitted += len(group)
                if start < n and (steps is None or emitted < steps):
                    pending, pending_rows = [take(block, start, n)], n - start
                if group:
                    held.produced += len(group) * bs
                    held.note()
                    yield group
                if steps is not None and emitted >= steps:
                    return emitted
        finally:
            blocks.close()
        return emitted

    def _blocks(self, epoch: int, held: HeldRows) -> Generator[Batch, None, None]:
        """Decoded (and shuffled) blocks, passing over the rows until the epoch's rows are out."""
        produced = 0
        pass_no = 0
        while True:
            rng = self._rng(epoch, pass_no)
            needed = self._rows_needed(pass_over=False)
            # A wrap-around pass without shuffling needs only its first rows: read no more.
            rows_left = None if self.shuffle or needed is None else needed - produced
            chunks = self._pass_chunks(rng, rows_left)
            blocks: Generator[Batch, None, None] = chunks
            buffer = None
            if self.shuffle:
                # The buffer's arrays go from pass to pass (a concurrent iterator makes its own).
                spare, self._spare_buffer = self._spare_buffer, None
                buffer = ShuffleBuffer(
                    self.shuffle_buffer_size, self.block_rows, rng, held, arrays=spare
                )
                blocks = buffer.shuffle(chunks)
            pass_rows = 0
            try:
                for block in blocks:
                    n = rows_of(block)
                    pass_rows += n
                    produced += n
                    yield block
                    if _reached(produced, self._rows_needed(pass_over=False)):
                        return
            finally:
                blocks.close()
                chunks.close()
                if buffer is not None:
                    self._spare_buffer = buffer.arrays
            if _reached(produced, self._rows_needed(pass_over=True)):
                return
            if pass_rows == 0:
                raise StoreError(
                    f"rank {self.rank}: a pass over its {self.split} rows gave no rows "
                    "(did transformation_fn drop them all?)"
                )
            pass_no += 1


def _reached(produced: int, needed: int | None) -> bool:
    return needed is not None and produced >= needed
