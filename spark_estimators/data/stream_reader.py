"""``data="stream"``, rank side: batches from the spill the rank's Spark task writes as it reads.

The task writes its partition as Arrow IPC segment files and announces each one on a pipe
(:mod:`spark_estimators.task.stream_spill`); :class:`StreamSource` follows the announcements on a
thread. :class:`StreamBatchReader` is a reader like :class:`~spark_estimators.data.BatchReader`
(``iter_epoch(block_format)``, ``set_epoch``, ``peek``, ``batch_size``, ``held_rows_peak``) behind
the same pipeline: decode to numpy, ``transformation_fn``, the block format (the framework's batch
converter) run in the prefetch thread, the :class:`~spark_estimators.data._pipeline.ShuffleBuffer`
and the :class:`~spark_estimators.data._pipeline.Prefetcher`.

Equal steps without knowing the rows up front
---------------------------------------------
The rule is the Parquet reader's: every rank takes ``T = max over ranks of ceil(rows / batch)``
steps per epoch, and a rank whose rows run out first wraps around its own rows (in a new order).
During the first epoch nobody knows ``T``: a rank trains on rows as they arrive (waiting for the
next segment when it is ahead of Spark), and only when its own rows are out does it need ``T``,
which arrives once every task has read its partition (the tasks exchange their row counts with
``BarrierTaskContext.allGather``). No collective op runs in the data path, so the agreement
cannot interleave with the framework's own collectives (Keras and Lightning fetch batches on other
threads). ``steps_per_epoch`` is always None and ``len()`` always raises ``TypeError``: every
epoch, also after the first, ends when the reader has given the agreed count, so every framework
runs each epoch until its loader ends. A count reported only once the totals had arrived differed
between ranks with timing (one rank built its loader before the totals came, the other after),
and a framework may run a collective for a sized loader only: Lightning's ``has_len_all_ranks``
reduces the lengths, and that reduce met the other rank's first gradient allreduce (a hang until
the collective timeout). ``agreed_steps`` reports the count for information once known.
``plan(limit, multiple)`` applies ``train_steps_per_epoch`` and ``backward_passes_per_step``
exactly as :func:`~spark_estimators.core.rank.epoch_steps` does for a known count.

Shuffling: the first epoch shuffles the rows in arrival order inside the shuffle buffer; later
epochs (and wrap-around passes) first permute the order of the segments (about 4 MB each, as the
Parquet reader permutes row-group slices), seeded by ``(seed, epoch, rank, pass)``.

Memory: the rank holds one decoded segment batch, the shuffle buffer and the prefetch queue, as
the Parquet reader does; the spill stays on disk (``held_rows_peak`` reports the high-water mark).

Bad rows: the driver checks what needs no job (columns exist, supported types, shapes); nulls,
NaNs and wrong lengths are only seen in the rows. The first time the reader decodes a segment it
checks every batch as the Parquet writer does (:func:`~spark_estimators.data._arrow.invalid_rows`)
and raises a :class:`~spark_estimators.errors.ConfigurationError` naming the column, the value and
the fix, so the fit fails with a ``TrainingFailedError`` at the first such row instead of training
on NaN or failing in the framework's collate.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators.data._arrow import invalid_rows, table_to_numpy
from spark_estimators.data._epochs import PipelineReader
from spark_estimators.data._pipeline import Batch, concat, rows_of, take
from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.data.options import TransformFn
from spark_estimators.data.reader import (
    _apply_transformation,
    _block_rows,
    default_shuffle_rows,
)
from spark_estimators.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    import pyarrow as pa

    from spark_estimators.data.options import ReaderOptions
    from spark_estimators.data.stream import StreamMetadata

__all__ = ["StreamBatchReader", "StreamSource", "rank_stream"]

_STREAM_FD_ENV = "SPARK_ESTIMATORS_STREAM_FD"  # task/stream_spill.py's STREAM_FD_ENV
_source: StreamSource | None = None
_source_lock = threading.Lock()


class StreamSource:
    """The segments and row counts the rank's task announces on the pipe ``fd``.

    ``segment(split, i)`` waits for the ``i``-th segment of a split (None once the partition is
    read and there is no such segment); ``totals()`` waits for every task's row counts.
    """

    def __init__(self, fd: int) -> None:
        self._cond = threading.Condition()
        self._segments: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
        self.ended = False
        self._totals: list[dict[str, int]] | None = None
        self._closed = False
        self._file = os.fdopen(fd, "r", encoding="utf-8")
        threading.Thread(target=self._follow, name="se-stream-source", daemon=True).start()

    def _follow(self) -> None:
        try:
            for line in self._file:
                kind, _, rest = line.rstrip("\n").partition(" ")
                with self._cond:
                    if kind == "S":
                        split, rows, path = rest.split(" ", 2)
                        self._segments[split].append((path, int(rows)))
                    elif kind == "E":
                        self.ended = True
                    elif kind == "T":
                        self._totals = json.loads(rest)
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _gone(self, what: str) -> StoreError:
        return StoreError(
            f"the Spark task stopped streaming before {what}: it failed or was cancelled "
            "(see the other ranks' and Spark's errors)"
        )

    def segment(self, split: str, index: int) -> tuple[str, int] | None:
        """``(path, rows)`` of segment ``index`` of ``split``, waiting for it; None past the end."""
        with self._cond:
            while True:
                segments = self._segments[split]
                if index < len(segments):
                    return segments[index]
                if self.ended:
                    return None
                if self._closed:
                    raise self._gone("the end of its partition")
                self._cond.wait()

    def segments(self, split: str) -> list[tuple[str, int]]:
        """The segments of ``split`` announced so far."""
        with self._cond:
            return list(self._segments[split])

    def rows(self, split: str) -> int:
        """Rows of ``split`` announced so far."""
        with self._cond:
            return sum(rows for _, rows in self._segments[split])

    def known_totals(self) -> list[dict[str, int]] | None:
        """Every task's row counts if they have arrived, else None (never waits)."""
        with self._cond:
            return self._totals

    def totals(self) -> list[dict[str, int]]:
        """Every task's ``{"train": rows, "val": rows}``, waiting until all tasks have read."""
        with self._cond:
            while self._totals is None:
                if self._closed:
                    raise self._gone("every task had read its partition")
                self._cond.wait()
            return self._totals


def rank_stream() -> StreamSource:
    """The stream of this rank process (one per process, opened on first use)."""
    global _source
    with _source_lock:
        if _source is None:
            fd = os.environ.get(_STREAM_FD_ENV)
            if not fd:
                raise ConfigurationError(
                    "data='stream' readers work only in a rank started by an estimator's fit "
                    "with data='stream' (no stream pipe in this process)"
                )
            _source = StreamSource(int(fd))
        return _source


def check_rows(batch: pa.RecordBatch, columns: Mapping[str, ColumnInfo], where: str) -> None:
    """Raise if a used column of ``batch`` has a null, a NaN or a row of the wrong length.

    The message names the column, the first bad value, ``where`` the rows came from, and the fix.
    """
    for name, info in columns.items():
        if info.is_sparse or name not in batch.schema.names:  # stream vectors arrive dense
            continue
        invalid, bad_length = invalid_rows(batch.column(name), info)
        for mask, problem in ((invalid, "null or NaN"), (bad_length, "wrong-length")):
            bad = np.flatnonzero(mask)
            if not len(bad):
                continue
            value = repr(batch.column(name)[int(bad[0])].as_py())
            value = value if len(value) <= 80 else value[:77] + "..."
            expected = "" if info.kind == "scalar" else f" (every row needs {info.size} values)"
            raise ConfigurationError(
                f"column {name!r} has {problem} values in {len(bad)} row(s) of a Spark batch "
                f"read by {where}, e.g. {value}{expected}; data='stream' checks rows as they "
                f"arrive, so the fit stops at the first such batch. Fill or drop these rows "
                f"before fit (df.na.drop(subset=[{name!r}]) or df.na.fill(...) for a scalar "
                "column; a filter for array/vector values), or use data='parquet' with "
                "drop_invalid_rows=True to drop them"
            )


def _steps_rule(steps: int, limit: int | None, multiple: int) -> int:
    """``epoch_steps``'s rule: cap by ``limit``, round up to a multiple of ``multiple``."""
    if limit is not None:
        steps = min(steps, int(limit)) if steps else int(limit)
    if multiple > 1:
        steps = max(multiple, -(-steps // multiple) * multiple)
    return steps


class StreamBatchReader(PipelineReader):
    """One split of this rank's streamed partition, in equal-sized batches (module docstring)."""

    def __init__(
        self,
        source: StreamSource,
        columns: Mapping[str, ColumnInfo],
        *,
        split: str = "train",
        rank: int = 0,
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int | None = 0,
        epoch: int = 0,
        shuffle_buffer_size: int | None = None,
        transformation_fn: TransformFn | None = None,
        prefetch: int = 2,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size={batch_size!r} must be a positive integer")
        self._init_epochs(split, batch_size, shuffle, seed, epoch)
        self.source = source
        self.columns = dict(columns)
        self.rank = rank
        self.shuffle_buffer_size = shuffle_buffer_size or default_shuffle_rows(
            self.columns, batch_size
        )
        self.block_rows = _block_rows(self.columns, batch_size)
        self.transformation_fn = transformation_fn
        self.prefetch = prefetch
        self._limit: int | None = None
        self._multiple = 1
        self._init_pipeline()
        self._checked: set[str] = set()  # segments whose rows passed check_rows

    # ------------------------------------------------------------------------ steps
    def plan(self, limit: int | None, multiple: int = 1) -> None:
        """Apply ``limit`` steps per epoch and a ``multiple`` to the epochs this reader counts."""
        self._limit, self._multiple = limit, max(int(multiple), 1)

    def _raw_steps(self, totals: Sequence[Mapping[str, int]]) -> int:
        rows = [int(t[self.split]) for t in totals]
        if self.split == "train" or any(rows):
            empty = [i for i, n in enumerate(rows) if n == 0]
            if empty:
                raise ConfigurationError(
                    f"{len(empty)} of {len(rows)} ranks got no {self.split} rows from the "
                    f"DataFrame ({sum(rows)} rows in all): every rank needs at least one; use "
                    "fewer processes or more data (a DataFrame with num_proc partitions and no "
                    "shuffle streams its partitions as they are: df.repartition(num_proc) "
                    "spreads the rows)"
                )
        return max(-(-n // self.batch_size) for n in rows)

    @property
    def steps_per_epoch(self) -> None:
        """Always None: the reader ends every epoch itself (see the module docstring).

        Whether the count is known yet depends on timing, which differs between ranks; a
        framework that shapes its loop (or runs a collective) by a known length would diverge.
        """
        return None

    @property
    def agreed_steps(self) -> int | None:
        """Batches per epoch on every rank (before ``plan``), None until the row counts arrive.

        For information only: it becomes known at different times on each rank.
        """
        totals = self.source.known_totals()
        return None if totals is None else self._raw_steps(totals)

    def _target(self, wait: bool) -> int | None:
        totals = self.source.totals() if wait else self.source.known_totals()
        if totals is None:
            return None
        return _steps_rule(self._raw_steps(totals), self._limit, self._multiple)

    def __len__(self) -> int:
        # Unsized on every rank at every moment (see steps_per_epoch): like an IterableDataset.
        raise TypeError(
            "a data='stream' reader has no len(): each epoch ends at the count the ranks agree "
            "on while reading (agreed_steps)"
        )

    # ------------------------------------------------------------------ PipelineReader's hooks
    def _steps_now(self) -> int | None:
        """The agreed count once known, else ``plan``'s limit (if any) as a cap meanwhile."""
        target = self._target(wait=False)
        if target is not None or self._limit is None:
            return target
        return _steps_rule(int(self._limit), None, self._multiple)

    def _rows_needed(self, pass_over: bool) -> int | None:
        """Not known mid-pass; once this rank's rows are out, the agreed count's rows."""
        if not pass_over:
            return None
        return (self._target(wait=True) or 0) * self.batch_size

    def _pass_chunks(
        self, rng: np.random.Generator, rows_left: int | None = None
    ) -> Generator[Batch, None, None]:
        """Decoded record batches of the segments, in arrival order or permuted.

        Arrival order while the partition is still being read; once it is, a permutation of the
        segments when shuffling. Whole segments are read (``rows_left`` is not used: the epoch
        stops taking blocks once it has its rows).
        """
        if self.source.ended:
            segments = self.source.segments(self.split)
            order = rng.permutation(len(segments)) if self.shuffle else range(len(segments))
            for i in order:
                yield from self._read_segment(segments[int(i)][0])
            return
        index = 0
        while (segment := self.source.segment(self.split, index)) is not None:
            yield from self._read_segment(segment[0])
            index += 1

    def _read_segment(self, path: str) -> Iterator[Batch]:
        import pyarrow as pa

        check = path not in self._checked  # the first read only: later epochs re-read the same
        with pa.OSFile(path) as f:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                if check:
                    check_rows(batch, self.columns, f"rank {self.rank} ({self.split} rows)")
                yield self._decode(batch)
        self._checked.add(path)

    def _decode(self, batch: pa.RecordBatch) -> Batch:
        arrays = table_to_numpy(batch, self.columns, writable=not self.shuffle)
        if self.transformation_fn is not None:
            arrays = _apply_transformation(self.transformation_fn, arrays)
        return arrays

    def peek(self) -> Batch:
        """The first ``batch_size`` rows of this rank's rows (no shuffle, no wrap)."""
        parts: list[Batch] = []
        index = 0
        while sum(rows_of(p) for p in parts) < self.batch_size:
            segment = self.source.segment(self.split, index)
            if segment is None:
                break
            parts.extend(self._read_segment(segment[0]))
            index += 1
        if not parts:
            raise ConfigurationError(f"rank {self.rank} got no {self.split} rows to look at")
        chunk = parts[0] if len(parts) == 1 else concat(parts)
        return take(chunk, 0, min(self.batch_size, rows_of(chunk)))


def open_stream_readers(
    meta: StreamMetadata,
    options_of: Callable[[str], ReaderOptions],
    rank: int,
    transformation_fn: TransformFn | None,
) -> tuple[StreamBatchReader, StreamBatchReader | None]:
    """The rank's train reader and its val reader (None without validation).

    ``options_of(split)`` gives the split's :class:`~spark_estimators.data.ReaderOptions`.
    """
    source = rank_stream()

    def open_split(split: str) -> StreamBatchReader:
        options = options_of(split)
        columns = {c: meta.columns[c] for c in options.columns or meta.columns}
        return StreamBatchReader(
            source,
            columns,
            split=split,
            rank=rank,
            batch_size=options.batch_size,
            shuffle=options.shuffle,
            seed=options.seed,
            shuffle_buffer_size=options.shuffle_buffer_size,
            transformation_fn=transformation_fn,
            prefetch=options.prefetch,
        )

    return open_split("train"), open_split("val") if meta.has_val else None
