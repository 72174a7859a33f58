"""The per-rank timeline writer the engine records its ops to (see :mod:`..api.timeline`)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_estimators.collective.runtime.requests import Request

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

    def record_batch(
        self, ran: list[Request], set_id: int, times: list[int], error: BaseException | None
    ) -> None:
        """Add the events of a batch the engine ran (fused when several).

        ``times``: its start, the end of its negotiation and a third entry when it ran inline.
        """
        end = time.perf_counter_ns()
        negotiated = times[1] if len(times) > 1 else end
        for request in ran:
            info: dict[str, object] = {"dtype": request.dtype, "what": request.description}
            info["inline"] = len(times) > 2
            if len(ran) > 1:
                info["fused"] = len(ran)
            if error is not None:
                info["error"] = str(error).splitlines()[0] if str(error) else type(error).__name__
            self.record(request.name, request.kind.name, set_id, times[0], negotiated, end, info,
                        request.queued_ns)  # fmt: skip

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
