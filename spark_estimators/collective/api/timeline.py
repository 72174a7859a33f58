"""The timeline: a per-rank Chrome trace of every collective op and its negotiation.

Enabled by ``init(timeline=path)``, ``spark_estimators.run(..., timeline=path)``,
``python -m spark_estimators.launch --timeline path``, or the environment variable
``SPARK_ESTIMATORS_TIMELINE`` (Horovod's ``HOROVOD_TIMELINE`` works too); also started and
stopped at run time with :func:`start_timeline` / :func:`stop_timeline`, as in Horovod. The
value ``DYNAMIC`` means what it means in Horovod: no timeline at ``init()``, one started later by
:func:`start_timeline`.

Each rank writes its own file: ``path`` with ``{rank}`` replaced, or else ``.rank<N>`` added
before the extension (``/tmp/tl.json`` -> ``/tmp/tl.rank0.json``, ``/tmp/tl.rank1.json``).
The file is Chrome's trace-event JSON (``{"traceEvents": [...]}``): open it in
``chrome://tracing`` or https://ui.perfetto.dev. :func:`merge` joins the ranks' files into one.

What is in it: one process row per rank (``pid`` = global rank, named ``rank N``) and one thread row
per tensor name, as in Horovod's timeline. An asynchronous op (or one submitted while others run)
first gets a ``QUEUE`` event: its wait in the engine's queue. Then each op adds two complete
(``"X"``) events: ``NEGOTIATE_<OP>`` (the negotiation round in which the ranks agree on the op,
which is where a rank waits for slower peers) and ``<OP>`` (the data movement; ``args.inline`` tells
whether the data travelled inside the negotiation). ``args`` also carry the process set id, the
dtype, the shape description, ``fused`` (the number of ops of a fused round, each of which gets
these events) and, for a failed op, the error. Timestamps are wall-clock microseconds, so the files
of several ranks line up on one machine.

The file is valid JSON after every flush (events are written in batches, at least once a
second while ops run, and when the rank ends), so a rank that dies keeps what it flushed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_FLUSH_EVENTS = 256
_FLUSH_SECONDS = 1.0
_TAIL = b"\n]}\n"
_open: list[Timeline] = []
_open_lock = threading.Lock()


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for a timeline ``path`` (see the module docstring)."""
    path = os.path.expanduser(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if os.path.isdir(path):
        return os.path.join(path, f"timeline.rank{rank}.json")
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    """Writes one rank's trace events to ``rank_path(path, rank)``."""

    def __init__(self, path: str, rank: int) -> None:
        self.rank = rank
        self.path = rank_path(path, rank)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._lock = threading.Lock()
        self._pending: list[dict[str, object]] = []
        self._tids: dict[str, int] = {}
        self._last_flush = time.monotonic()
        # Wall-clock microseconds at a perf_counter origin: precise and comparable across ranks.
        self._origin_ns = time.perf_counter_ns()
        self._origin_us = time.time_ns() / 1000.0
        with open(self.path, "wb") as f:
            head = {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "args": {"name": f"rank {rank}"},
            }
            f.write(b'{"displayTimeUnit": "ms", "traceEvents": [\n' + json.dumps(head).encode())
            f.write(_TAIL)
        self._closed = False
        with _open_lock:
            _open.append(self)

    def micros(self, perf_ns: int) -> float:
        """Wall-clock microseconds of a ``time.perf_counter_ns()`` reading."""
        return self._origin_us + (perf_ns - self._origin_ns) / 1000.0

    def record(
        self,
        name: str,
        op: str,
        set_id: int,
        start_ns: int,
        negotiated_ns: int,
        end_ns: int,
        args: dict[str, object],
        queued_ns: int = 0,
    ) -> None:
        """Add the events of one op (``perf_counter_ns`` times; ``queued_ns`` 0: not queued)."""
        with self._lock:
            if self._closed:
                return
            tid = self._tids.get(name)
            if tid is None:
                tid = self._tids[name] = len(self._tids) + 1
                self._pending.append({"name": "thread_name", "ph": "M", "pid": self.rank,
                                      "tid": tid, "args": {"name": name}})  # fmt: skip
            common = {"pid": self.rank, "tid": tid}
            info = {"tensor": name, "process_set": set_id, **args}
            if queued_ns:
                self._pending.append({"name": "QUEUE", "cat": "queue", "ph": "X",
                                      "ts": self.micros(queued_ns),
                                      "dur": (start_ns - queued_ns) / 1000.0, **common,
                                      "args": {"tensor": name, "process_set": set_id}})  # fmt: skip
            self._pending.append({"name": f"NEGOTIATE_{op}", "cat": "negotiation", "ph": "X",
                                  "ts": self.micros(start_ns),
                                  "dur": (negotiated_ns - start_ns) / 1000.0, **common,
                                  "args": {"tensor": name, "process_set": set_id}})  # fmt: skip
            self._pending.append({"name": op, "cat": "op", "ph": "X",
                                  "ts": self.micros(negotiated_ns),
                                  "dur": (end_ns - negotiated_ns) / 1000.0, **common,
                                  "args": info})  # fmt: skip
            now = time.monotonic()
            if len(self._pending) >= _FLUSH_EVENTS or now - self._last_flush > _FLUSH_SECONDS:
                self._flush_locked(now)

    def flush(self) -> None:
        """Write the pending events; the file stays valid JSON."""
        with self._lock:
            self._flush_locked(time.monotonic())

    def _flush_locked(self, now: float) -> None:
        self._last_flush = now
        if not self._pending or self._closed:
            return
        data = b"".join(b",\n" + json.dumps(e).encode() for e in self._pending)
        self._pending = []
        try:
            with open(self.path, "r+b") as f:
                f.seek(-len(_TAIL), os.SEEK_END)
                f.write(data + _TAIL)
        except OSError as exc:  # never fail a collective op over its trace
            logger.warning("timeline %s could not be written (%s); stopping it", self.path, exc)
            self._closed = True

    def close(self) -> None:
        """Flush and stop recording."""
        self.flush()
        with self._lock:
            self._closed = True
        with _open_lock:
            if self in _open:
                _open.remove(self)


def flush_all() -> None:
    """Flush every open timeline (rank processes call it before ``os._exit``)."""
    with _open_lock:
        timelines = list(_open)
    for timeline in timelines:
        timeline.flush()


def merge(paths: Sequence[str], out: str) -> str:
    """Join several ranks' timeline files into one trace file ``out`` and return its path."""
    events: list[dict[str, object]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            events.extend(json.load(f)["traceEvents"])
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    return out


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this rank's timeline to ``file_path`` (Horovod's ``hvd.start_timeline``).

    ``mark_cycles`` is accepted for Horovod compatibility and marks nothing: each op's ``QUEUE``
    and ``NEGOTIATE_<OP>`` events show its wait. Every rank should call it; each writes its own
    file. With ``HOROVOD_TIMELINE=DYNAMIC`` this is how the timeline starts (``init()`` starts
    none).
    """
    from spark_estimators.collective.runtime import engine as _engine
    from spark_estimators.collective.runtime import process_sets as _sets

    engine = _engine.require("start_timeline")
    if engine.timeline is not None:
        engine.timeline.close()
    timeline = Timeline(file_path, engine.backend.rank)
    engine.timeline = timeline
    for ps in _sets.registered():
        if ps._engine is not None:
            ps._engine.timeline = timeline


def stop_timeline() -> None:
    """Stop the timeline started by ``init(timeline=...)`` or :func:`start_timeline`."""
    from spark_estimators.collective.runtime import engine as _engine
    from spark_estimators.collective.runtime import process_sets as _sets

    engine = _engine.require("stop_timeline")
    timeline, engine.timeline = engine.timeline, None
    for ps in _sets.registered():
        if ps._engine is not None:
            ps._engine.timeline = None
    if timeline is not None:
        timeline.close()


__all__ = ["Timeline", "flush_all", "merge", "rank_path", "start_timeline", "stop_timeline"]
