"""The collective engine: one background thread per process that runs every collective op.

Why a thread: asynchronous ops (``allreduce_async_`` from gradient hooks) must run while the
caller keeps computing, and running every op in submission order keeps the order of ops
identical on all ranks, which collectives need. A *blocking* op submitted while nothing is
queued or running is executed directly in the caller's thread (under the same execution lock),
which saves two thread hand-offs; otherwise it queues behind the ops submitted before it.

Negotiation (how mismatches become errors instead of hangs): before each op the ranks allgather
a small int64 vector: op kind, a hash of the op's signature (name, dtype, shapes, reduction,
root, scale factors), and what a joined rank needs to take part (element count, dtype, device,
wire op). If the non-joined ranks disagree, every rank learns it from the same gathered
vectors, all of them exchange readable descriptions in one more round, and all raise
:class:`~spark_estimators.errors.CollectiveError` naming the tensor and each rank's view of it.
The group stays usable afterwards. Cost: one small allgather per op (per fused bucket).

Inline allreduces: a CPU allreduce whose data fits the vector's payload room travels inside that
allgather and is reduced locally in rank order (the same result on every rank): one round trip
instead of two. On a small job this is also cheaper than the backend's allreduce (Gloo's ring
takes more message rounds than one allgather). The room starts at ``INLINE_BYTES`` and follows
the largest inline-able allreduce of the last ``ROOM_WINDOW`` rounds, up to the inline limit
(``SPARK_ESTIMATORS_INLINE_LIMIT``, default ``1 MiB / size`` capped at 256 KiB), so a training
loop whose fused gradient bucket is below the limit pays one round trip per step from its second
step on. Every rank computes the room from the gathered vectors only (each rank's wish and limit
travel in the header), so all ranks always send vectors of the same length, which the allgather
needs; a mismatched op is still detected from the header before any data is used.

Join: a rank that called ``join()`` keeps negotiating; while others still run allreduces it
contributes zeros (so ``Average`` still divides by ``size()``, as in Horovod) and barriers pass.
Other ops raise on the non-joined ranks. ``join()`` returns the rank that joined last.

Failures: an exception from the backend (a peer died, the collective timeout passed) fails the
op with :class:`CollectiveError` and marks the group broken; later ops fail at once with the
original cause instead of hanging.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import DTYPES, Backend, ReduceOp, dtype_code
from spark_estimators.collective.runtime import settings
from spark_estimators.errors import CollectiveError, ConfigurationError, SparkEstimatorsError

logger = logging.getLogger(__name__)


class Kind(enum.IntEnum):
    """The kinds of collective request; the number travels in the negotiation vector."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7
    ALLGATHER_OBJECT = 8
    BROADCAST_OBJECT = 9
    PROCESS_SET = 10


# Layout of the negotiation vector: a header, then room for an allreduce's data.
_KIND, _SIG, _JOINED, _DIM0, _NUMEL, _DTYPE, _WIRE_OP, _DEVICE, _INLINE, _WANT, _LIMIT = range(11)
_HEADER_LEN = 11
#: The fixed payload room: an allreduce of at most this many bytes always travels inline.
INLINE_BYTES = 512
#: The room grows to the largest inline-able allreduce of this many recent rounds.
ROOM_WINDOW = 32
_DEVICES = ("cpu", "cuda")
# Ops a joined rank can take part in (it contributes zeros / nothing).
_JOINABLE = (Kind.ALLREDUCE, Kind.BARRIER)


@dataclass(frozen=True)
class Agreement:
    """What negotiation tells an op: every rank's first dimension, and who has joined."""

    dim0s: list[int]
    joined: list[int]
    #: Every rank's inline payload (``uint8`` rows; zeros for joined ranks), or None.
    payloads: np.ndarray | None = None


@dataclass
class Request:
    """One collective op, as submitted by an API function.

    ``signature`` must be equal on every rank; ``execute`` runs on the engine thread after
    negotiation. ``numel``/``dtype``/``device``/``wire_op`` describe the single flat reduction
    an allreduce performs, which is what a joined rank mirrors with zeros.
    """

    kind: Kind
    name: str
    signature: tuple[Any, ...]
    execute: Callable[[Agreement], Any]
    description: str
    numel: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    wire_op: ReduceOp = ReduceOp.SUM
    dim0: int = 0
    #: For small allreduces: returns this rank's data as bytes to send inside the negotiation.
    inline: Callable[[], np.ndarray] | None = None
    future: Future[Any] = field(default_factory=Future)
    #: ``perf_counter_ns()`` when it entered the engine's queue (timeline only; 0: not queued).
    queued_ns: int = 0


def signature_hash(signature: tuple[Any, ...]) -> int:
    """A stable signed 64-bit hash of a signature tuple (same on every rank and run)."""
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class _Recoverable(SparkEstimatorsError):
    """Raised by negotiation when every rank fails the op the same way; the group survives."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class Handle:
    """An asynchronous op in flight; pass it to ``synchronize()`` or ``poll()``.

    It covers one or more engine requests (a grouped op with several dtypes is one request
    per dtype). ``finish`` runs in the caller's thread in :meth:`wait` and turns the list of
    request results into the op's return value (e.g. decompresses it).
    """

    __slots__ = ("_finish", "_futures", "name")

    def __init__(
        self,
        futures: Sequence[Future[Any]],
        name: str,
        finish: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self._futures = list(futures)
        self._finish = finish
        self.name = name

    def done(self) -> bool:
        """True when every part of the op has finished."""
        return all(f.done() for f in self._futures)

    def wait(self) -> Any:
        """Block until the op finished and return its result (raises the op's error)."""
        results = [f.result() for f in self._futures]
        if self._finish is not None:
            return self._finish(results)
        return results[0] if len(results) == 1 else results

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"Handle({self.name!r}, {state})"


class Engine:
    """Runs collective requests on a background thread over one :class:`Backend`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="se-collective", daemon=True)
        self._round = 0
        self._broken: CollectiveError | None = None
        self._closed = False
        self._names_lock = threading.Lock()
        self._counters: dict[str, int] = {}
        # Held while an op runs (engine thread or caller); with _pending it keeps the order.
        self._exec_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending = 0  # submitted to the queue and not finished
        # Payload room of the next negotiation vector (bytes, a multiple of 8): the same on
        # every rank because it is computed from gathered vectors only (see _grow_room).
        self._room = INLINE_BYTES
        self._wants: deque[int] = deque(maxlen=ROOM_WINDOW)
        self._limit = settings.inline_limit(backend.size)
        #: The process set this engine serves (0: the global set).
        self.set_id = 0
        #: A :class:`~spark_estimators.collective.api.timeline.Timeline` recording the ops, or None.
        self.timeline: Any = None

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def broken(self) -> CollectiveError | None:
        """The error that broke the group, or None while it works."""
        return self._broken

    @property
    def inline_room(self) -> int:
        """Bytes of allreduce data the next negotiation vector can carry."""
        return self._room

    def auto_name(self, op: str) -> str:
        """Horovod-style generated name for an unnamed op (``allreduce.noname.3``)."""
        with self._names_lock:
            n = self._counters.get(op, 0)
            self._counters[op] = n + 1
        return f"{op}.noname.{n}"

    def submit(self, request: Request, blocking: bool = False) -> Future[Any]:
        """Queue ``request``; returns its future.

        ``blocking=True`` (the caller waits for the result right away) runs the op in the
        caller's thread when nothing is queued or running, which saves two thread hand-offs
        per op; otherwise it waits its turn in the queue like an async op.
        """
        if self._closed:
            raise CollectiveError(
                f"{request.kind.name.lower()} {request.name!r}: the collective layer was shut "
                "down; call init() again first"
            )
        if blocking and self._exec_lock.acquire(blocking=False):
            try:
                with self._pending_lock:
                    idle = self._pending == 0
                if idle:
                    self._run(request)
                    return request.future
            finally:
                self._exec_lock.release()
        if self.timeline is not None:
            request.queued_ns = time.perf_counter_ns()
        with self._pending_lock:
            self._pending += 1
        self._queue.put(request)
        return request.future

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread after the queued ops; False when it did not stop within ``timeout``."""
        if self._closed:
            return True
        self._closed = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            with self._exec_lock:
                try:
                    self._run(request)
                finally:
                    with self._pending_lock:
                        self._pending -= 1

    def _run(self, request: Request) -> None:
        """Negotiate and execute one request, settling its future (never raises)."""
        if not request.future.set_running_or_notify_cancel():
            return
        if self._broken is not None:
            request.future.set_exception(self._broken_error(request))
            return
        try:
            result = self._process(request)
        except _Recoverable as exc:
            request.future.set_exception(exc.error)
        except (CollectiveError, ConfigurationError) as exc:
            request.future.set_exception(exc)
        except BaseException as exc:
            error = self._backend_error(request, exc)
            self._broken = error
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    def _broken_error(self, request: Request) -> CollectiveError:
        assert self._broken is not None
        error = CollectiveError(
            f"{request.kind.name.lower()} {request.name!r} not run on rank {self.backend.rank}: "
            f"the collective group is broken since an earlier op failed ({self._broken})"
        )
        error.__cause__ = self._broken
        return error

    def _backend_error(self, request: Request, exc: BaseException) -> CollectiveError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        text = re.sub(r"^\[[^\]]*\.(cc|cpp|h)(:\d+)?\]\s*", "", text)  # gloo's source location
        hint = "a peer rank probably died or stopped calling collectives; check its log"
        if "timed out" in text.lower() or "timeout" in text.lower():
            hint = (
                f"no peer answered within the collective timeout ({self.backend.timeout:g} s, "
                f"{ev.COLLECTIVE_TIMEOUT})"
            )
        error = CollectiveError(
            f"{request.kind.name.lower()} {request.name!r} failed on rank {self.backend.rank} "
            f"(backend {self.backend.name}): {text}; {hint}"
        )
        error.__cause__ = exc
        logger.debug("collective op failed", exc_info=exc)
        return error

    def _negotiate(self, vector: np.ndarray) -> np.ndarray:
        self._round += 1
        length = vector.size
        gathered = self.backend.allgather(vector.reshape(1, length), [1] * self.backend.size)
        vectors = np.asarray(gathered, dtype=np.int64).reshape(self.backend.size, length)
        self._grow_room(vectors)
        return vectors

    def _grow_room(self, vectors: np.ndarray) -> None:
        """Set the next round's payload room from this round's vectors (same on every rank)."""
        limit = int(vectors[:, _LIMIT].min())
        wants = [int(w) for w in vectors[:, _WANT] if 0 < w <= limit]
        self._wants.append(max(wants, default=0))
        self._room = max(INLINE_BYTES, -(-max(self._wants) // 8) * 8)

    def _empty_vector(self) -> np.ndarray:
        vector = np.zeros(_HEADER_LEN + self._room // 8, dtype=np.int64)
        vector[_LIMIT] = self._limit
        return vector

    def _vector(self, request: Request) -> np.ndarray:
        vector = self._empty_vector()
        vector[_KIND] = int(request.kind)
        vector[_SIG] = signature_hash(request.signature)
        vector[_JOINED] = -1
        vector[_DIM0] = request.dim0
        vector[_NUMEL] = request.numel
        vector[_DTYPE] = dtype_code(request.dtype)
        vector[_WIRE_OP] = int(request.wire_op)
        vector[_DEVICE] = _DEVICES.index(request.device) if request.device in _DEVICES else 0
        if request.inline is not None:
            nbytes = request.numel * np.dtype(request.dtype).itemsize
            vector[_WANT] = nbytes
            if nbytes <= self._room:
                payload = np.asarray(request.inline(), dtype=np.uint8).reshape(-1)
                vector[_INLINE] = 1
                vector[_HEADER_LEN:].view(np.uint8)[: payload.size] = payload
        return vector

    @staticmethod
    def _active(vectors: np.ndarray) -> list[int]:
        return [r for r in range(vectors.shape[0]) if vectors[r, _JOINED] < 0]

    @staticmethod
    def _agree(vectors: np.ndarray, active: Sequence[int]) -> bool:
        first = vectors[active[0]]
        return all(
            vectors[r, _KIND] == first[_KIND] and vectors[r, _SIG] == first[_SIG] for r in active
        )

    def _process(self, request: Request) -> Any:
        if request.kind is Kind.JOIN:
            return self._join()
        timeline = self.timeline
        if timeline is None:
            return self._negotiate_and_execute(request, None)
        start = time.perf_counter_ns()
        times = [start]
        info: dict[str, Any] = {"dtype": request.dtype, "what": request.description}
        try:
            return self._negotiate_and_execute(request, times)
        except BaseException as exc:
            info["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise
        finally:
            end = time.perf_counter_ns()
            negotiated = times[1] if len(times) > 1 else end
            info["inline"] = len(times) > 2
            op = request.kind.name
            timeline.record(
                request.name, op, self.set_id, start, negotiated, end, info, request.queued_ns
            )

    def _negotiate_and_execute(self, request: Request, times: list[int] | None) -> Any:
        """``times`` (timeline only) gets the end of negotiation, and a third entry if inline."""
        vectors = self._negotiate(self._vector(request))
        active = self._active(vectors)
        if not self._agree(vectors, active):
            self._raise_mismatch(request, vectors)
        joined = [r for r in range(self.backend.size) if r not in active]
        if joined and request.kind not in _JOINABLE:
            raise CollectiveError(
                f"{request.kind.name.lower()} {request.name!r}: rank(s) {joined} already called "
                "join(); only allreduce and barrier can run until every rank has joined"
            )
        dim0s = [int(d) for d in vectors[:, _DIM0]]
        payloads = None
        if vectors[self.backend.rank, _INLINE]:  # then every active rank sent its data inline
            payloads = np.ascontiguousarray(vectors[:, _HEADER_LEN:]).view(np.uint8)
        if times is not None:
            times.append(time.perf_counter_ns())
            if payloads is not None:
                times.append(1)
        return request.execute(Agreement(dim0s=dim0s, joined=joined, payloads=payloads))

    def _raise_mismatch(self, request: Request | None, vectors: np.ndarray) -> None:
        """Every rank comes here from the same vectors: exchange descriptions, then raise."""
        mine = None if request is None else (request.kind.name.lower(), request.description)
        views = self.backend.allgather_object(mine)
        if request is None:  # a joined rank: nothing of its own failed
            return
        lines = []
        for r, view in enumerate(views):
            lines.append(f"  rank {r}: " + ("join()" if view is None else f"{view[0]} {view[1]}"))
        raise _Recoverable(
            CollectiveError(
                f"mismatched collective op for {request.name!r} across ranks (nothing was "
                "exchanged; every rank raises this error):\n"
                + "\n".join(lines)
                + "\nEvery rank must call the same ops in the same order with the same names, "
                "dtypes and shapes (allgather/alltoall may differ in the first dimension)."
            )
        )

    def _join(self) -> int:
        joined_at = self._round
        while True:
            vector = self._empty_vector()
            vector[_KIND] = int(Kind.JOIN)
            vector[_JOINED] = joined_at
            vectors = self._negotiate(vector)
            active = self._active(vectors)
            if not active:
                # The last to join has the highest join round (ties: the highest rank).
                return max(range(vectors.shape[0]), key=lambda r: (vectors[r, _JOINED], r))
            if not self._agree(vectors, active):
                self._raise_mismatch(None, vectors)
                continue
            row = vectors[active[0]]
            inline = bool(row[_INLINE])  # the data came with the negotiation: nothing to do
            if Kind(int(row[_KIND])) is Kind.ALLREDUCE and row[_NUMEL] > 0 and not inline:
                zeros = self.backend.zeros(
                    int(row[_NUMEL]), DTYPES[int(row[_DTYPE])], _DEVICES[int(row[_DEVICE])]
                )
                self.backend.allreduce(zeros, ReduceOp(int(row[_WIRE_OP])))


_engine: Engine | None = None
_engine_lock = threading.RLock()


def current() -> Engine | None:
    """The running engine, or None before ``init()``."""
    return _engine


def require(op: str, process_set: Any = None) -> Engine:
    """The engine that runs ``op``: the global one, or ``process_set``'s.

    Clear errors when ``init()`` has not been called, or this rank is not a member of
    ``process_set`` (a :class:`~spark_estimators.collective.runtime.process_sets.ProcessSet`).
    """
    engine = _engine
    if engine is None:
        raise CollectiveError(
            f"{op}() was called before init(): call spark_estimators.collective.init() "
            "(hvd.init()) in every rank first"
        )
    if process_set is None:
        return engine
    resolve = getattr(process_set, "_require_engine", None)
    if resolve is None:
        raise ConfigurationError(
            f"{op}(process_set={process_set!r}): process_set takes a ProcessSet "
            "(hvd.global_process_set, or one from hvd.add_process_set / init(process_sets=...))"
        )
    return resolve(op)  # type: ignore[no-any-return]


def install(engine: Engine | None) -> None:
    """Set (or clear) the process-wide engine; used by ``init()`` / ``shutdown()``."""
    global _engine
    _engine = engine


def lock() -> threading.RLock:
    """The lock ``init()`` and ``shutdown()`` hold while they change the engine."""
    return _engine_lock
