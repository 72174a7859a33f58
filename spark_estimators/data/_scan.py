"""Parquet row-group slices -> Arrow record batches, in order, decoded ahead on worker threads.

Why not one ``pyarrow.dataset`` scan: the dataset scanner decodes a whole row group at once (and
keeps its compressed bytes and intermediate buffers alongside), so memory follows the row-group
size times the read-ahead; measured on 100k-row groups of 10 doubles, the scanner peaked at 60-90
MB of Arrow memory where ``iter_batches`` (which decodes ``batch_rows`` rows at a time from pages
read through a 1 MB buffer) needed 12-15 MB, at less CPU per row (~190 against ~300 ns on 32
floats). Parallelism comes from ``workers`` long-lived threads, each streaming every
``workers``-th slice into a queue of ``depth`` batches (Arrow releases the GIL while it decodes),
while the slices are handed out strictly in order. Memory is then about
``workers * (depth + 2) * batch_rows`` rows, whatever the size of the data or its row groups; the
reader picks ``depth`` (4 when the rank has spare cores, so the next slice's thread can run ahead
while the current slice is consumed, else 1).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from spark_estimators.errors import StoreError

_POLL_SECONDS = 0.1
# Local files are read through a buffer of this size, page by page; without it Parquet reads a
# whole column chunk (the row group's share of the column) at once.
READ_BUFFER_BYTES = 1 << 20
_DONE = object()


def put_unless_stopped(into: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` into the bounded queue ``into``; False if ``stop`` is set while it is full.

    What a producer thread does with each item: waiting for room in short polls, so that it gives
    up (and can be joined) once the consumer has stopped taking items out.
    """
    while not stop.is_set():
        try:
            into.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def stop_producers(stop: threading.Event, queues: Sequence[queue.Queue[object]]) -> None:
    """Set ``stop`` and empty ``queues``, so that producers blocked on a full queue return now.

    A producer waiting in :func:`put_unless_stopped` would otherwise notice ``stop`` only at its
    next poll, up to ``_POLL_SECONDS`` later, and whoever joins it waits that long: at the end of
    every epoch that stops a scan early (the wrap-around pass reads a few rows of its first
    slice) that was 0-100 ms, a third of a 1M-row epoch at raw pyarrow speed. The items are
    dropped (nobody takes them any more); a producer puts at most one more, into the room made.
    """
    stop.set()
    for q in queues:
        while True:
            try:
                q.get_nowait()
            except queue.Empty:
                break


@dataclass(frozen=True)
class ScanPiece:
    """Rows ``[start, stop)`` of row group ``row_group`` (``group_rows`` rows) of ``path``."""

    path: str
    row_group: int
    start: int
    stop: int
    group_rows: int


class _Worker:
    """One thread streaming the record batches of every ``step``-th piece into a bounded queue.

    It lives for the whole scan (threads made per piece cost mimalloc fresh heaps each: +40 MB of
    resident memory at 1M rows, measured); ``_DONE`` closes each piece.
    """

    def __init__(self, scan: OrderedScan, first: int, step: int) -> None:
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=scan.depth)
        self._scan = scan
        self._pieces = scan.pieces[first::step]
        self.thread = threading.Thread(
            target=self._run, name=f"spark_estimators-io-{os.getpid()}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        try:
            for piece in self._pieces:
                for batch in self._scan.read_piece(piece):
                    if not self._put(batch):
                        return
                if not self._put(_DONE):
                    return
        except BaseException as exc:  # raised in the consuming thread
            self._put(exc)

    def _put(self, item: Any) -> bool:
        return put_unless_stopped(self.queue, item, self._scan.stopped)


class OrderedScan:
    """Record batches of ``pieces`` in order; ``workers`` pieces are decoded ahead at once.

    Iterate it once (``batches()``); closing the generator stops and joins the threads.
    """

    def __init__(
        self,
        filesystem: Any,
        pieces: Sequence[ScanPiece],
        columns: Sequence[str],
        batch_rows: int,
        workers: int = 1,
        depth: int = 1,
        metadata_cache: dict[str, Any] | None = None,
    ) -> None:
        import pyarrow.fs as pafs

        self.filesystem = filesystem
        self.pieces = list(pieces)
        self.columns = list(columns)
        self.batch_rows = batch_rows
        self.workers = max(workers, 1)
        self.depth = max(depth, 1)
        self.stopped = threading.Event()
        # Coalesced whole-row-group reads pay off on object stores, not on local disks.
        self.pre_buffer = not isinstance(filesystem, pafs.LocalFileSystem)
        self._metadata = metadata_cache if metadata_cache is not None else {}

    def read_piece(self, piece: ScanPiece) -> Generator[Any, None, None]:
        """The piece's rows as record batches of at most ``batch_rows`` rows (any thread)."""
        with self.filesystem.open_input_file(piece.path) as handle:
            reader = _open_parquet(
                handle,
                metadata=self._metadata.get(piece.path),
                pre_buffer=self.pre_buffer,
                buffer_size=0 if self.pre_buffer else READ_BUFFER_BYTES,
            )
            meta = reader.metadata
            self._metadata.setdefault(piece.path, meta)
            if (
                piece.row_group >= meta.num_row_groups
                or meta.row_group(piece.row_group).num_rows != piece.group_rows
            ):
                raise changed(piece)
            offset = 0
            rows = min(self.batch_rows, piece.stop)  # a short piece: decode no more than it
            for batch in reader.iter_batches(rows, piece.row_group, self.columns):
                n = batch.num_rows
                lo, hi = max(piece.start - offset, 0), min(piece.stop - offset, n)
                if lo < hi:
                    yield batch if (lo, hi) == (0, n) else batch.slice(lo, hi - lo)
                offset += n
                if offset >= piece.stop or self.stopped.is_set():
                    return

    def batches(self) -> Generator[tuple[int, Any, bool], None, None]:
        """``(piece index, record batch, last batch of the piece)`` in piece order."""
        step = min(self.workers, len(self.pieces))
        workers = [_Worker(self, w, step) for w in range(step)]
        try:
            for k in range(len(self.pieces)):
                source = workers[k % step].queue
                pending = None
                while True:
                    item = source.get()
                    if isinstance(item, BaseException):
                        raise item
                    if pending is not None:
                        yield k, pending, item is _DONE
                    if item is _DONE:
                        break
                    pending = item
        finally:
            stop_producers(self.stopped, [worker.queue for worker in workers])
            for worker in workers:
                worker.thread.join()


class _ParquetRows:
    """A Parquet file's row groups as record batches, decoded into the reader's memory pool.

    ``pq.ParquetFile`` always decodes into Arrow's default pool (mimalloc in the wheels), which
    kept ~40 MB more resident memory with our decode threads at 1M rows than jemalloc or the
    system allocator (measured with bench/memory.py); ``ParquetReader`` takes a pool. When the
    private reader class is missing or changed, ``pq.ParquetFile`` is used.
    """

    def __init__(self, reader: Any, public: bool) -> None:
        self._reader = reader
        self._public = public
        self.metadata = reader.metadata
        self._leaves: dict[str, list[int]] = {}
        if not public:
            schema = self.metadata.schema
            for i in range(len(schema)):
                self._leaves.setdefault(schema.column(i).path.split(".")[0], []).append(i)

    def iter_batches(self, batch_rows: int, row_group: int, columns: list[str]) -> Any:
        if self._public:
            return self._reader.iter_batches(
                batch_size=batch_rows, row_groups=[row_group], columns=columns, use_threads=False
            )
        indices = sorted(i for name in columns for i in self._leaves.get(name, []))
        return self._reader.iter_batches(
            batch_rows, [row_group], column_indices=indices, use_threads=False
        )


def reader_pool() -> Any:
    """The Arrow memory pool of the reader: jemalloc, else the system allocator."""
    import pyarrow as pa

    global _POOL
    if _POOL is None:
        try:
            _POOL = pa.jemalloc_memory_pool()
        except NotImplementedError:  # a pyarrow built without jemalloc (e.g. Windows)
            _POOL = pa.system_memory_pool()
    return _POOL


_POOL: Any = None


def _open_parquet(handle: Any, *, metadata: Any, pre_buffer: bool, buffer_size: int) -> Any:
    try:
        from pyarrow._parquet import ParquetReader

        reader = ParquetReader(memory_pool=reader_pool())
        reader.open(handle, metadata=metadata, pre_buffer=pre_buffer, buffer_size=buffer_size)
        return _ParquetRows(reader, public=False)
    except (ImportError, TypeError, AttributeError):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(
            handle, metadata=metadata, pre_buffer=pre_buffer, buffer_size=buffer_size
        )
        return _ParquetRows(pf, public=True)


def changed(piece: ScanPiece) -> StoreError:
    """The error for a row group whose size is not what the dataset metadata says."""
    return StoreError(
        f"{piece.path!r} row group {piece.row_group} has another row count than the dataset "
        "metadata says; the data changed after it was prepared"
    )
