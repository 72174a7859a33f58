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
instead of two (a fused batch travels inline when all of it fits). On a small job this is also
cheaper than the backend's allreduce (Gloo's ring takes more message rounds than one allgather).
The room starts at ``INLINE_BYTES`` and follows the largest inline-able allreduce of the last
``ROOM_WINDOW`` rounds, up to the inline limit (``SPARK_ESTIMATORS_INLINE_LIMIT``, default
``1 MiB / size`` capped at 256 KiB), so a training loop whose fused gradient bucket is below the
limit pays one round trip per step from its second step on. Every rank computes the room from the
gathered vectors only (each rank's wish and limit travel in the header), so all ranks always send
vectors of the same length, which the allgather needs; a mismatched op is still detected from the
header before any data is used.

Fusion (Horovod's tensor fusion and cycle time): asynchronous allreduces queue up while the
caller keeps submitting. The engine thread takes the oldest queued op and, if it is an allreduce
that can be fused, waits until ``cycle_time`` has passed since it was submitted
(``SPARK_ESTIMATORS_CYCLE_TIME`` / ``HOROVOD_CYCLE_TIME``, milliseconds, default 1), or less
as soon as someone waits for a result (``synchronize``, ``wait``, a blocking op) or polls one.
Then it negotiates the head op together with the allreduces queued right behind it that share
its dtype, device, reduction and scaling, up to the fusion threshold
(``SPARK_ESTIMATORS_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``, bytes, default 128 MiB;
0 disables fusion), and runs the prefix that every rank listed identically as one reduction of
one packed buffer (see :mod:`.negotiation`). Horovod's coordinator can also fuse ops that ranks
submitted in different orders; here the order must be the same on every rank (it already had
to be), and a different order fails with the mismatch error below instead of hanging.

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
from spark_estimators.collective.backends.base import DTYPES, Backend, ReduceOp
from spark_estimators.collective.runtime import negotiation as neg
from spark_estimators.collective.runtime import settings
from spark_estimators.collective.runtime.negotiation import (  # noqa: F401  their old home
    INLINE_BYTES,
    ROOM_WINDOW,
)
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


# Ops a joined rank can take part in (it contributes zeros / nothing).
_JOINABLE = (Kind.ALLREDUCE, Kind.BARRIER)


@dataclass(frozen=True)
class Agreement:
    """What negotiation tells an op: every rank's first dimension, and who has joined."""

    dim0s: list[int]
    joined: list[int]
    #: Every rank's inline payload (``uint8`` rows; zeros for joined ranks), or None.
    payloads: np.ndarray | None = None


@dataclass(frozen=True)
class Fusion:
    """How an allreduce request is fused with the ones queued behind it.

    Requests with equal ``key`` (this process only: framework, dtype, device, reduction,
    scaling) may run as one: ``run(requests, agreement)`` reduces them together and returns
    each request's result, in order. ``part`` is the op's own data for ``run``.
    """

    key: tuple[Any, ...]
    nbytes: int
    run: Callable[[Sequence[Request], Agreement], list[Any]]
    part: Any


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
    #: For allreduces that may be fused with their neighbours in the queue.
    fusion: Fusion | None = None
    future: Future[Any] = field(default_factory=Future)
    #: ``perf_counter_ns()`` when it entered the engine's queue (0: run without queueing).
    queued_ns: int = 0
    _hash: int | None = field(default=None, repr=False)

    @property
    def signature_hash(self) -> int:
        """:func:`signature_hash` of the signature (computed once)."""
        if self._hash is None:
            self._hash = signature_hash(self.signature)
        return self._hash


def signature_hash(signature: tuple[Any, ...]) -> int:
    """A stable signed 64-bit hash of a signature tuple (same on every rank and run)."""
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class _Recoverable(SparkEstimatorsError):
    """Raised by negotiation when every rank fails the op the same way; the group survives."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _OpFuture(Future[Any]):
    """A request's future that tells the engine when someone waits for it or polls it.

    A waiter ends the engine's cycle wait at once: nothing more is coming from this thread
    until the result is there, so holding the queued ops back would only add latency.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine = engine

    def result(self, timeout: float | None = None) -> Any:
        if self.done():
            return super().result(timeout)
        self._engine._waiting(1)
        try:
            return super().result(timeout)
        finally:
            self._engine._waiting(-1)

    def flush(self) -> None:
        """Ask the engine to run what is queued now instead of at the end of its cycle."""
        if not self.done():
            self._engine.flush()


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
        """True when every part of the op has finished (else the engine runs it soon)."""
        if all(f.done() for f in self._futures):
            return True
        for f in self._futures:
            flush = getattr(f, "flush", None)
            if flush is not None:
                flush()
        return False

    def wait(self) -> Any:
        """Block until the op finished and return its result (raises the op's error)."""
        results = [f.result() for f in self._futures]
        if self._finish is not None:
            return self._finish(results)
        return results[0] if len(results) == 1 else results

    def __repr__(self) -> str:
        state = "done" if all(f.done() for f in self._futures) else "pending"
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
        # Threads blocked on a result, and the signal that ends the engine's cycle wait early.
        self._waiters = 0
        self._urgent = threading.Event()
        self._negotiation = neg.Negotiation(settings.inline_limit(backend.size))
        #: Seconds a fusable op may wait in the queue for more to fuse with (the cycle time).
        self.cycle_time = settings.cycle_time() / 1000.0
        #: Most bytes one fused allreduce reduces (0: no fusion).
        self.fusion_threshold = settings.fusion_threshold()
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
        return self._negotiation.room

    @property
    def rounds(self) -> int:
        """Negotiation rounds so far (one per op or fused batch of ops)."""
        return self._round

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
                    self._run([request])
                    return request.future
            finally:
                self._exec_lock.release()
        request.future = _OpFuture(self)
        request.queued_ns = time.perf_counter_ns()
        with self._pending_lock:
            self._pending += 1
        self._queue.put(request)
        return request.future

    def flush(self) -> None:
        """End the current cycle wait: negotiate what is queued now."""
        self._urgent.set()

    def _waiting(self, delta: int) -> None:
        with self._pending_lock:
            self._waiters += delta
        if delta > 0:
            self._urgent.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread after the queued ops; False when it did not stop within ``timeout``."""
        if self._closed:
            return True
        self._closed = True
        self._queue.put(None)
        self._urgent.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        pending: deque[Request] = deque()
        stopping = False
        while True:
            if not pending:
                if stopping:
                    return
                request = self._queue.get()
                if request is None:
                    return
                pending.append(request)
            stopping = self._gather(pending, stopping)
            done = 1
            with self._exec_lock:
                try:
                    done = self._run(self._batch(pending))
                finally:
                    for _ in range(done):
                        pending.popleft()
                    with self._pending_lock:
                        self._pending -= done

    def _drain(self, pending: deque[Request]) -> bool:
        """Move what is queued now into ``pending``; True when the stop marker came."""
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return False
            if request is None:
                return True
            pending.append(request)

    def _gather(self, pending: deque[Request], stopping: bool) -> bool:
        """Collect queued requests, waiting out the head's cycle when its batch could grow."""
        stopping = self._drain(pending) or stopping
        if not stopping and self.cycle_time > 0 and self._waiters == 0 and self._can_grow(pending):
            deadline = pending[0].queued_ns / 1e9 + self.cycle_time
            remaining = deadline - time.perf_counter()
            if remaining > 0:
                self._urgent.wait(remaining)
            stopping = self._drain(pending) or stopping
        self._urgent.clear()
        return stopping

    def _batch(self, pending: deque[Request]) -> list[Request]:
        """The head and the queued requests right behind it that it may be fused with."""
        head = pending[0]
        fusion = head.fusion
        batch = [head]
        if fusion is None or self.fusion_threshold <= 0:
            return batch
        total = fusion.nbytes
        for i in range(1, len(pending)):
            other = pending[i].fusion
            if other is None or other.key != fusion.key or len(batch) >= neg.MAX_SLOTS:
                break
            if total + other.nbytes > self.fusion_threshold:
                break
            batch.append(pending[i])
            total += other.nbytes
        return batch

    def _can_grow(self, pending: deque[Request]) -> bool:
        """True when one more queued request could still join the head's batch."""
        fusion = pending[0].fusion
        if fusion is None or self.fusion_threshold <= 0:
            return False
        batch = self._batch(pending)
        if len(batch) < len(pending) or len(batch) >= neg.MAX_SLOTS:
            return False  # the batch already ends at a request that cannot join it
        return sum(r.fusion.nbytes for r in batch if r.fusion) < self.fusion_threshold

    def _run(self, batch: list[Request]) -> int:
        """Negotiate ``batch`` and run the agreed part; settles those futures (never raises).

        Returns how many requests of ``batch`` (its first ones) were settled. (The MPI backend's
        watchdog finds the op it serves in this frame's ``request`` local.)
        """
        head = request = batch[0]
        if self._broken is not None:
            if head.future.set_running_or_notify_cancel():
                head.future.set_exception(self._broken_error(head))
            return 1
        timeline = self.timeline
        start = time.perf_counter_ns()
        times = [start]
        ran = batch[:1]
        results: list[Any] = []
        error: BaseException | None = None
        try:
            if head.kind is Kind.JOIN:
                timeline = None  # join() is not an op of the timeline
                results = [self._join()]
            else:
                count, agreement = self._negotiate_batch(batch, times)
                ran = batch[:count]
                results = self._execute(ran, agreement)
        except _Recoverable as exc:
            error = exc.error
        except (CollectiveError, ConfigurationError) as exc:
            error = exc
        except BaseException as exc:
            error = self._backend_error(request, exc)
            self._broken = error
        if timeline is not None:
            self._record(timeline, ran, times, error)
        for i, settled in enumerate(ran):
            if not settled.future.set_running_or_notify_cancel():
                continue
            if error is not None:
                settled.future.set_exception(error)
            else:
                settled.future.set_result(results[i])
        return len(ran)

    def _negotiate_batch(self, batch: list[Request], times: list[int]) -> tuple[int, Agreement]:
        """Agree on what runs this round (``times`` gets the negotiation's end, and 1 if inline)."""
        head = batch[0]
        vectors = self._negotiate(self._negotiation.vector(batch))
        active = self._active(vectors)
        if not self._agree(vectors, active):
            self._raise_mismatch(head, vectors)
        joined = [r for r in range(self.backend.size) if r not in active]
        if joined and head.kind not in _JOINABLE:
            raise CollectiveError(
                f"{head.kind.name.lower()} {head.name!r}: rank(s) {joined} already called "
                "join(); only allreduce and barrier can run until every rank has joined"
            )
        plan = self._negotiation.plan(vectors, active)
        payloads = self._negotiation.payloads(vectors) if plan.inline else None
        times.append(time.perf_counter_ns())
        if payloads is not None:
            times.append(1)
        dim0s = [int(d) for d in vectors[:, neg.DIM0]]
        return plan.count, Agreement(dim0s=dim0s, joined=joined, payloads=payloads)

    def _execute(self, ran: list[Request], agreement: Agreement) -> list[Any]:
        head = ran[0]
        if len(ran) == 1:
            return [head.execute(agreement)]
        assert head.fusion is not None
        return head.fusion.run(ran, agreement)

    def _record(
        self, timeline: Any, ran: list[Request], times: list[int], error: BaseException | None
    ) -> None:
        end = time.perf_counter_ns()
        negotiated = times[1] if len(times) > 1 else end
        for request in ran:
            info: dict[str, Any] = {"dtype": request.dtype, "what": request.description}
            info["inline"] = len(times) > 2
            if len(ran) > 1:
                info["fused"] = len(ran)
            if error is not None:
                info["error"] = str(error).splitlines()[0] if str(error) else type(error).__name__
            timeline.record(
                request.name, request.kind.name, self.set_id, times[0], negotiated, end, info,
                request.queued_ns,
            )  # fmt: skip

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
        self._negotiation.update(vectors)
        return vectors

    @staticmethod
    def _active(vectors: np.ndarray) -> list[int]:
        return [r for r in range(vectors.shape[0]) if vectors[r, neg.JOINED] < 0]

    @staticmethod
    def _agree(vectors: np.ndarray, active: Sequence[int]) -> bool:
        first = vectors[active[0]]
        return all(
            vectors[r, neg.KIND] == first[neg.KIND] and vectors[r, neg.SIG] == first[neg.SIG]
            for r in active
        )

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
            vector = self._negotiation.empty()
            vector[neg.KIND] = int(Kind.JOIN)
            vector[neg.JOINED] = joined_at
            vectors = self._negotiate(vector)
            active = self._active(vectors)
            if not active:
                # The last to join has the highest join round (ties: the highest rank).
                return max(range(vectors.shape[0]), key=lambda r: (vectors[r, neg.JOINED], r))
            if not self._agree(vectors, active):
                self._raise_mismatch(None, vectors)
                continue
            row = vectors[active[0]]
            plan = self._negotiation.plan(vectors, active)
            # An inline batch came with the negotiation: nothing more to take part in.
            if Kind(int(row[neg.KIND])) is Kind.ALLREDUCE and plan.numel > 0 and not plan.inline:
                zeros = self.backend.zeros(
                    plan.numel, DTYPES[int(row[neg.DTYPE])], neg.DEVICES[int(row[neg.DEVICE])]
                )
                self.backend.allreduce(zeros, ReduceOp(int(row[neg.WIRE_OP])))


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
