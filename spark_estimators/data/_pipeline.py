"""The reader's pipeline: block formats, batch cutting, the shuffle buffer, the prefetch thread.

Memory is bounded by construction, whatever the data size: the shuffle buffer is one set of
arrays of ``capacity`` rows allocated once and refilled (no per-fill concatenation), permuted rows
leave it in blocks of at most ``block_rows``, and the prefetch queue holds ``depth`` groups of
batches. :class:`HeldRows` counts the decoded rows the reader holds at once (its high-water mark is
``BatchReader.held_rows_peak``), so tests can check the bound.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_estimators.data._scan import put_unless_stopped, reader_pool, stop_producers
from spark_estimators.data._staging import Allocator

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class BlockFormat:
    """How batches are made from decoded numpy blocks: ``convert`` a whole block, then slice.

    ``convert`` runs in the reader's background thread; ``concat`` joins the pieces of a batch that
    spans several blocks. The torch adapter uses ``torch.from_numpy`` and ``torch.cat``.
    ``pin_memory`` / ``staging``: where the rows of CPU torch batches are copied in that thread
    (:mod:`spark_estimators.data._staging`): pinned host memory with ``pin_memory=True``, and by
    default (``None``) when this process has initialised CUDA; ``staging`` is any allocator
    ``(shape, dtype) -> tensor`` and wins over ``pin_memory``.
    """

    convert: Callable[[Batch], dict[str, Any]]
    concat: Callable[[list[Any]], Any]
    pin_memory: bool | None = None
    staging: Allocator | None = None


def _same(block: Batch) -> Batch:
    return block


NUMPY_BLOCKS = BlockFormat(convert=_same, concat=np.concatenate, pin_memory=False)


def rows_of(block: dict[str, Any]) -> int:
    """Rows of a block (0 for an empty dict)."""
    return len(next(iter(block.values()))) if block else 0


def take(block: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)`` of every column (views)."""
    return {k: v[start:stop] for k, v in block.items()}


def concat(blocks: list[Any], join: Callable[[list[Any]], Any] = np.concatenate) -> Any:
    """Blocks joined row-wise, column by column."""
    return {k: join([b[k] for b in blocks]) for k in blocks[0]}


def split_batches(block: dict[str, Any], start: int, count: int, size: int) -> list[dict[str, Any]]:
    """``count`` batches of ``size`` rows from row ``start`` on, as views of ``block``.

    torch tensors are cut with one ``Tensor.split`` call per column (C++); numpy with slices.
    """
    if count <= 0:
        return []
    stop = start + count * size
    columns = []
    for v in block.values():
        if isinstance(v, np.ndarray):
            columns.append([v[i : i + size] for i in range(start, stop, size)])
        else:
            columns.append(v[start:stop].split(size))
    names = list(block)
    return [dict(zip(names, parts, strict=True)) for parts in zip(*columns, strict=True)]


class HeldRows:
    """Decoded rows the reader holds (shuffle buffer, blocks, queued batches) and the peak.

    The producer thread adds, the consumer subtracts; each side writes its own counter, so no lock
    is needed. ``peak`` is the most ever held at once.
    """

    def __init__(self) -> None:
        self.buffered = 0  # producer: rows in the shuffle buffer and blocks being cut
        self.produced = 0  # producer: rows put in batches so far
        self.consumed = 0  # consumer: rows of batch groups fully handed out
        self.peak = 0

    def note(self) -> None:
        """Update the peak (called by the producer after each change)."""
        held = self.buffered + self.produced - self.consumed
        if held > self.peak:
            self.peak = held


class ShuffleBuffer:
    """Rows permuted in fills of ``capacity`` rows; permuted rows leave in blocks of ``block_rows``.

    The arrays are allocated once (on the first row, from its dtypes and shapes, unless ``arrays``
    of a previous pass fit) and refilled; output blocks are fresh writable arrays (``np.take``),
    never views of the buffer, so the arrays can serve the next pass (reused and held in jemalloc,
    see :func:`pool_empty`, a rank's peak RSS over 10 epochs of 5M rows fell from 425-428 MB to
    405-406 MB, measured with bench/memory.py). The blocks themselves are plain ``np.take``
    results: gathering into pool memory (``out=``) measured 2x slower.
    """

    def __init__(
        self,
        capacity: int,
        block_rows: int,
        rng: np.random.Generator,
        held: HeldRows,
        arrays: Batch | None = None,
    ) -> None:
        self.capacity = capacity
        self.block_rows = max(block_rows, 1)
        self.rng = rng
        self.held = held
        self._arrays = arrays if arrays and rows_of(arrays) == capacity else None
        self._filled = 0

    @property
    def arrays(self) -> Batch | None:
        """The buffer's arrays (for the next pass); their contents are spent."""
        return self._arrays

    def shuffle(self, chunks: Iterable[Batch]) -> Generator[Batch, None, None]:
        """Permuted blocks of every row of ``chunks`` (each row exactly once)."""
        for chunk in chunks:
            n, pos = rows_of(chunk), 0
            while pos < n:
                if self._arrays is not None and not self._fits(chunk):
                    yield from self._drain()
                    self._arrays = None
                if self._arrays is None:
                    self._arrays = {
                        k: pool_empty((self.capacity, *v.shape[1:]), v.dtype)
                        for k, v in chunk.items()
                    }
                m = min(self.capacity - self._filled, n - pos)
                for k, v in self._arrays.items():
                    v[self._filled : self._filled + m] = chunk[k][pos : pos + m]
                self._filled += m
                pos += m
                self.held.buffered = self._filled
                self.held.note()
                if self._filled == self.capacity:
                    yield from self._drain()
        yield from self._drain()

    def _fits(self, chunk: Batch) -> bool:
        arrays = self._arrays or {}
        return list(arrays) == list(chunk) and all(
            arrays[k].dtype == v.dtype and arrays[k].shape[1:] == v.shape[1:]
            for k, v in chunk.items()
        )

    def _drain(self) -> Generator[Batch, None, None]:
        filled, arrays = self._filled, self._arrays
        if not filled or arrays is None:
            return
        order = self.rng.permutation(filled)
        for a in range(0, filled, self.block_rows):
            idx = order[a : a + self.block_rows]
            yield {k: np.take(v, idx, axis=0) for k, v in arrays.items()}
            self.held.buffered = filled - a - len(idx)
        self._filled = 0


def pool_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised writable array in the reader's Arrow memory pool (jemalloc).

    Large numpy allocations freed every block raise glibc's mmap threshold, after which its heap
    keeps what it once held (a fixed ``MALLOC_MMAP_THRESHOLD_`` lowered the peak over 8 epochs
    from 425 to 396 MB in a test); jemalloc returns freed memory to the system.
    """
    import pyarrow as pa

    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype)
    buf = pa.allocate_buffer(count * dtype.itemsize, memory_pool=reader_pool())
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


_END = object()


class Prefetcher:
    """Runs a generator in a daemon thread, ``depth`` items ahead; inline when depth 0."""

    def __init__(self, source: Iterator[Any], depth: int) -> None:
        self._source = source
        self._depth = depth
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Iterator[Any]:
        if self._depth == 0:
            return self._source
        self._thread = threading.Thread(
            target=self._run, name=f"spark_estimators-reader-{os.getpid()}", daemon=True
        )
        self._thread.start()
        return self._drain()

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item) or self._stop.is_set():
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def _put(self, item: Any) -> bool:
        return put_unless_stopped(self._queue, item, self._stop)

    def _drain(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, *exc: object) -> None:
        stop_producers(self._stop, [self._queue])
        if self._thread is not None:
            self._thread.join()
        elif self._depth == 0:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
