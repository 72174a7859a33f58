"""``data="stream"``, task side: the barrier task writes its partition to a rank-local spill.

The training stage maps over the user's (prepared, repartitioned) DataFrame. Its task starts the
rank process as usual (:func:`~spark_estimators.task.spark_task.run_rank`, on a thread) and, on
its own thread, drains the partition's Arrow batches as fast as Spark delivers them into a spill
directory on the executor's local disk (the first of ``SPARK_LOCAL_DIRS``, Spark's own scratch
space, else the temp dir): Arrow IPC *segment* files of about ``SEGMENT_BYTES`` per split, each
written under a temporary name and renamed when complete. The rank learns of each segment
through a FIFO in the spill directory (its path is ``SPARK_ESTIMATORS_STREAM_FIFO``; the rank
process opens it and names its fd in ``SPARK_ESTIMATORS_STREAM_FD``, so a forked rank process
started before the task can take the stream too), one text line per event::

    S <split> <rows> <path>       a complete segment of "train" or "val" rows
    E <train rows> <val rows>     this partition is fully read
    T <json list>                 every task's {"train": n, "val": m}, in partition order

The totals come from ``BarrierTaskContext.allGather`` once every task has read its partition: the
ranks need them to agree on the first epoch's step count (see
:mod:`spark_estimators.data.stream_reader`). Memory stays bounded: a task holds one Arrow batch
and an open segment writer per split; the rank reads segments from disk. The spill directory is
removed when the task ends, also when its rank failed; a task killed outright leaves it in Spark's
local directory, which Spark removes with the executor.

``data="parquet+stream"`` (:attr:`StreamTaskSettings.copy`): the same drain also hands every
batch to ``prepare_data``'s Parquet writer (:class:`~spark_estimators.data._writer.PartitionSink`),
which writes the partition into the dataset's directories in the store under names no reader
picks up until the driver publishes the metadata. When the rank ends before its partition is
read (a step limit), the drain goes on for the copy alone. A task returns its writer's report
(:func:`run_streaming_rank`); a rank that failed or was stopped deletes what its task wrote. A
store that refuses a file ends the copy (the report says why), not the training.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Protocol

from spark_estimators.errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import BarrierTaskContext

#: Environment variable naming the notification pipe's fd in the rank process.
STREAM_FD_ENV = "SPARK_ESTIMATORS_STREAM_FD"
#: Environment variable of the rank process: the path of the notification FIFO.
STREAM_FIFO_ENV = "SPARK_ESTIMATORS_STREAM_FIFO"
#: Bytes of Arrow data per spill segment (the first segment is cut after one batch).
SEGMENT_BYTES = 4 << 20


class CopySink(Protocol):
    """One partition's Parquet writers (:class:`~spark_estimators.data._writer.PartitionSink`)."""

    def write(self, batch: pa.RecordBatch) -> None:
        """Check and write one batch."""

    def close(self) -> list[str]:
        """Finish the files; the driver's lines."""

    def abort(self) -> None:
        """Delete every file written."""


class CopyPlan(Protocol):
    """The copy's writer settings (:class:`~spark_estimators.data._writer.PartitionWriter`)."""

    def open(self, part: int, attempt: int) -> CopySink:
        """The writers of partition ``part``, task attempt ``attempt``."""


@dataclass(frozen=True)
class StreamTaskSettings:
    """How a task spills: the validation flag column (None: all rows train) and segment size.

    ``copy``: with ``data="parquet+stream"``, the writer of the store's Parquet copy.
    """

    split_col: str | None = None
    segment_bytes: int = SEGMENT_BYTES
    copy: CopyPlan | None = None


class ParquetCopy:
    """One partition's share of the Parquet copy, written beside the spill (or its failure).

    Parameters
    ----------
    plan
        ``prepare_data``'s writer settings (store, directories, token, columns, slices).
    part, attempt
        The Spark partition and task attempt (they name the files).
    """

    def __init__(self, plan: CopyPlan, part: int, attempt: int) -> None:
        self.error: str | None = None
        self._lines: list[str] = []
        self._sink: CopySink | None = None
        try:
            self._sink = plan.open(part, attempt)
        except (StoreError, OSError) as exc:
            self.error = str(exc)

    def write(self, batch: pa.RecordBatch) -> None:
        """Write one batch; after a store error, nothing (the report carries the error)."""
        if self._sink is None:
            return
        try:
            self._sink.write(batch)
        except (StoreError, OSError) as exc:
            self.error = str(exc)
            self.abort()

    def close(self) -> None:
        """Finish the files (called once the partition is read, while the rank may train on)."""
        if self._sink is None:
            return
        try:
            self._lines = self._sink.close()
        except (StoreError, OSError) as exc:
            self.error = str(exc)
            self.abort()

    def report(self) -> str:
        """The JSON the driver gets: ``{"lines": [files..., stats]}`` or ``{"error": ...}``."""
        if self.error is not None:
            return json.dumps({"error": self.error})
        return json.dumps({"lines": self._lines})

    def abort(self) -> None:
        """Delete every file of this share, closed or not (a failed rank, a store error)."""
        if self._sink is not None:
            self._sink.abort()
            self._sink = None
        self._lines = []


def spill_parent() -> str | None:
    """The executor's local directory for the spill: Spark's first local dir, else None (tmp)."""
    for path in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if path and os.path.isdir(path):
            return path
    return None


class SpillWriter:
    """Writes one partition's record batches as train/val segment files and tells the rank.

    Parameters
    ----------
    directory
        The spill directory (created by the caller, removed by the caller).
    notify
        The write end of the rank's notification pipe (a text file object, line-buffered).
    settings
        The validation flag column and the segment size.
    """

    def __init__(self, directory: str, notify: IO[str], settings: StreamTaskSettings) -> None:
        self.directory = directory
        self.settings = settings
        self.rows = {"train": 0, "val": 0}
        self._notify: IO[str] | None = notify
        # split -> (file, IPC writer, final path, rows, bytes) of its open segment
        self._open: dict[str, tuple[pa.NativeFile, pa.ipc.RecordBatchFileWriter, str, int, int]]
        self._open = {}
        self._segments = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Append one Arrow record batch (its validation rows go to the val segments)."""
        import pyarrow.compute as pc

        col = self.settings.split_col
        if col is None:
            self._append("train", batch)
            return
        flag = batch.column(col)
        kept = batch.drop_columns([col])
        self._append("train", kept.filter(pc.invert(flag)))
        self._append("val", kept.filter(flag))

    def _append(self, split: str, batch: pa.RecordBatch) -> None:
        import pyarrow as pa

        if batch.num_rows == 0:
            return
        if split not in self._open:
            self._segments += 1
            path = os.path.join(self.directory, f"{split}-{self._segments:06d}.arrow")
            sink = pa.OSFile(path + ".tmp", "wb")
            self._open[split] = (sink, pa.ipc.new_file(sink, batch.schema), path, 0, 0)
        sink, writer, path, rows, nbytes = self._open[split]
        writer.write_batch(batch)
        rows, nbytes = rows + batch.num_rows, nbytes + batch.nbytes
        self._open[split] = (sink, writer, path, rows, nbytes)
        self.rows[split] += batch.num_rows
        # The first segment is cut at once: the rank starts training after one batch.
        if nbytes >= self.settings.segment_bytes or self._segments == 1:
            self._close(split)

    def _close(self, split: str) -> None:
        sink, writer, path, rows, _ = self._open.pop(split)
        writer.close()
        sink.close()
        os.replace(path + ".tmp", path)
        self.send(f"S {split} {rows} {path}")

    def finish(self) -> None:
        """The partition is read: close the open segments and tell the rank its row counts."""
        for split in list(self._open):
            self._close(split)
        self.send(f"E {self.rows['train']} {self.rows['val']}")

    def totals(self, counts: list[dict[str, int]]) -> None:
        """Tell the rank every task's row counts (in partition order)."""
        self.send("T " + json.dumps(counts))

    def send(self, line: str) -> None:
        """One event line to the rank; a rank that is gone (closed pipe) is not an error here."""
        if self._notify is None:
            return
        try:
            self._notify.write(line + "\n")
            self._notify.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.close()

    def close(self) -> None:
        """Close the pipe and any open segment (the files are removed with the directory)."""
        for sink, writer, _, _, _ in self._open.values():
            with contextlib.suppress(Exception):
                writer.close()
            with contextlib.suppress(Exception):
                sink.close()
        self._open.clear()
        if self._notify is not None:
            with contextlib.suppress(OSError, ValueError):
                self._notify.close()
            self._notify = None


RankRunner = Callable[[str, dict[str, Any]], int]


def open_stream_fifo() -> None:
    """In a rank process: open the task's notification FIFO, name its fd in the environment.

    The task holds the FIFO open for writing, so the open does not block; the reader
    (:mod:`spark_estimators.data.stream_reader`) reads the fd named in ``STREAM_FD_ENV``.
    """
    path = os.environ.get(STREAM_FIFO_ENV)
    if path and not os.environ.get(STREAM_FD_ENV):
        os.environ[STREAM_FD_ENV] = str(os.open(path, os.O_RDONLY))


def run_streaming_rank(
    settings: StreamTaskSettings,
    batches: Iterator[pa.RecordBatch],
    ctx: BarrierTaskContext,
    run_rank: RankRunner,
) -> tuple[int, str]:
    """Start the rank (``run_rank(fifo_path, outcome)`` on a thread), spill ``batches`` for it.

    Returns the rank and the Parquet copy's report (:meth:`ParquetCopy.report`; "" without
    ``settings.copy``). The totals are exchanged with every task (``ctx.allGather``) once the
    partition is read, or as soon as the rank process has ended successfully (a step limit can
    end training before the data does); a rank that failed skips it, since the job is aborting
    and Spark cancels the other tasks.
    """
    directory = tempfile.mkdtemp(prefix="se-stream-", dir=spill_parent())
    fifo = os.path.join(directory, "notify.fifo")
    os.mkfifo(fifo, 0o600)
    # A read end held until the rank process has exited (as a pipe's read end that the rank
    # inherits): events wait in the FIFO until the rank opens it, and a write after the rank is
    # gone fails (EPIPE) instead of blocking. It makes the write-only open return at once.
    read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    write_fd = os.open(fifo, os.O_WRONLY)
    writer = SpillWriter(directory, os.fdopen(write_fd, "w", encoding="utf-8"), settings)
    copy = None
    if settings.copy is not None:
        copy = ParquetCopy(settings.copy, ctx.partitionId(), ctx.attemptNumber())
    done = threading.Event()
    ranks: list[int] = []
    errors: list[BaseException] = []
    outcome: dict[str, Any] = {}

    def rank_main() -> None:
        try:
            ranks.append(run_rank(fifo, outcome))
        except BaseException as exc:  # raised again in the task's thread
            errors.append(exc)
        finally:
            os.close(read_fd)  # the rank process opened its own; it has exited now
            done.set()

    thread = threading.Thread(target=rank_main, name="se-stream-rank", daemon=True)
    thread.start()
    report = ""
    try:
        exchanged = False
        for batch in batches:
            if done.is_set():
                if copy is None or outcome.get("code") != 0:
                    break
                if not exchanged:  # the rank is done: its peers may wait for the totals
                    _exchange_totals(ctx, writer)
                    exchanged = True
                copy.write(batch)  # the rest of the partition, for the copy alone
                continue
            writer.write(batch)
            if copy is not None:
                copy.write(batch)
        else:
            writer.finish()
        going = not done.is_set() or outcome.get("code") == 0
        if not exchanged and going:
            _exchange_totals(ctx, writer)  # first: the ranks wait for it to end their epoch
        if copy is not None and going:
            copy.close()  # its last row groups and footers, while the rank may still train
        thread.join()
        if copy is not None:
            if errors or outcome.get("code") != 0:
                copy.abort()  # the fit fails: nothing of this share stays
            report = copy.report()
    except BaseException:
        if copy is not None:
            copy.abort()
        raise
    finally:
        writer.close()
        shutil.rmtree(directory, ignore_errors=True)
    if errors:
        raise errors[0]
    return ranks[0], report


def _exchange_totals(ctx: BarrierTaskContext, writer: SpillWriter) -> None:
    """Every task's row counts, gathered from all tasks and told to this task's rank."""
    replies = ctx.allGather(json.dumps(writer.rows))
    writer.totals([json.loads(r) for r in replies])
