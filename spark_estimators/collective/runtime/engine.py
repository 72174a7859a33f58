"""The collective engine: one background thread per process that runs every collective op.

Why a thread: asynchronous ops (``allreduce_async_`` from gradient hooks) must run while the
caller keeps computing, and running every op in submission order keeps the order of ops
identical on all ranks, which collectives need. A *blocking* op submitted while nothing is
queued is executed directly in the caller's thread (under the same execution lock), which saves
two thread hand-offs; otherwise it queues behind the ops submitted before it. Likewise a thread
that waits for a queued op (``synchronize``) runs the queue up to that op itself.

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
caller keeps submitting. While the oldest queued op is an allreduce whose batch could still
grow, the engine thread waits until no new op has come for ``cycle_time``
(``SPARK_ESTIMATORS_CYCLE_TIME`` / ``HOROVOD_CYCLE_TIME``, milliseconds, default 1, Horovod's
default), or less as soon as someone waits for a result (``synchronize``, ``wait``, a blocking
op) or polls one. (Horovod's thread wakes every cycle; waiting for a quiet cycle instead keeps a
burst of per-parameter submissions, which takes longer than a cycle in Python, in one round.)
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
import itertools
import logging
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


@dataclass(slots=True)
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
    #: Set by :meth:`Engine.submit` (which returns it).
    future: Future[Any] = field(init=False, repr=False)
    #: ``perf_counter_ns()`` when it entered the engine's queue (0: run without queueing).
    queued_ns: int = 0
    _hash: int | None = field(default=None, repr=False)

    @property
    def signature_hash(self) -> int:
        """:func:`signature_hash` of the signature (computed once)."""
        if self._hash is None:
            try:
                self._hash = _hash_cache.get(self.signature)
            except TypeError:  # an unhashable signature: no caching
                self._hash = signature_hash(self.signature)
            if self._hash is None:
                self._hash = signature_hash(self.signature)
                if len(_hash_cache) < _HASH_CACHE_SIZE:
                    _hash_cache[self.signature] = self._hash
        return self._hash


# Training loops repeat the same ops step after step: hash each signature once.
_hash_cache: dict[tuple[Any, ...], int] = {}
_HASH_CACHE_SIZE = 65536


_PENDING, _RUNNING, _FINISHED = "PENDING", "RUNNING", "FINISHED"  # as Future names them


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
    """The future of a submitted op: a light :class:`~concurrent.futures.Future`.

    Waiting for a queued op runs it (and the ops queued before it) in the waiting thread when
    no other thread is running ops: the waiter would only sleep until the engine thread is done,
    and on a busy machine each of those thread hand-offs costs more than a small op. Otherwise
    the waiter ends the engine's cycle wait at once: nothing more is coming from this thread
    until the result is there, so holding the queued ops back would only add latency.

    Unlike a plain ``Future`` it has no lock of its own: the engine settles a whole fused batch
    and then wakes the waiting threads once (per-op locks and wake-ups cost more than the
    reduction of a small tensor). A submitted op cannot be cancelled (the other ranks count on
    it), so ``cancel()`` returns False.
    """

    def __init__(self, engine: Engine) -> None:  # no Future.__init__: no per-op Condition
        self._engine = engine
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[Any]], object]] = []

    def done(self) -> bool:
        """True once the op has finished (result or error)."""
        return self._state == _FINISHED

    def running(self) -> bool:
        """True while the op runs."""
        return self._state == _RUNNING

    def cancelled(self) -> bool:
        """Always False: submitted ops are not cancelled."""
        return False

    def cancel(self) -> bool:
        """Refuse: the other ranks count on every submitted op."""
        return False

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        """Call ``fn(self)`` when the op finishes (at once if it has)."""
        # No lock: list append/remove/pop are atomic, and exactly one side takes ``fn`` out.
        self._callbacks.append(fn)
        if self._state == _FINISHED:
            try:
                self._callbacks.remove(fn)
            except ValueError:
                return  # _finish took it
            fn(self)

    def set_running_or_notify_cancel(self) -> bool:
        """Mark the op running (the engine calls it)."""
        self._state = _RUNNING
        return True

    def set_result(self, result: Any) -> None:
        """Settle with ``result``; the engine wakes the waiters once per batch."""
        self._result = result
        self._finish()

    def set_exception(self, exception: BaseException | None) -> None:
        """Settle with an error; the engine wakes the waiters once per batch."""
        self._exception = exception
        self._finish()

    def _finish(self) -> None:
        self._state = _FINISHED
        while self._callbacks:
            try:
                fn = self._callbacks.pop(0)
            except IndexError:
                break
            try:
                fn(self)
            except Exception:
                logger.exception("a done callback of a collective op failed")

    def _wait(self, timeout: float | None) -> None:
        if self._state == _FINISHED:
            return
        if timeout is None:
            self._engine._run_until(self)
            if self._state == _FINISHED:
                return
        engine = self._engine
        engine._waiting(1)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            with engine._done_cv:
                while self._state != _FINISHED:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"collective op not finished within {timeout} s")
                    engine._done_cv.wait(left)
        finally:
            engine._waiting(-1)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the op and return its result (raises its error)."""
        self._wait(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the op and return its error, or None."""
        self._wait(timeout)
        return self._exception

    def flush(self) -> None:
        """Ask the engine to run what is queued now instead of at the end of its cycle."""
        if self._state != _FINISHED:
            self._engine.flush()

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _RUNNING: "running", _FINISHED: "finished"}[self._state]
        return f"<_OpFuture {state}>"


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
        self._thread = threading.Thread(target=self._loop, name="se-collective", daemon=True)
        self._round = 0
        self._broken: CollectiveError | None = None
        self._closed = False
        self._names_lock = threading.Lock()
        self._counters: dict[str, itertools.count[int]] = {}
        # Held while ops run (engine thread or caller). Submitted ops wait in _backlog, in
        # submission order; only the holder of _exec_lock takes them out, from the front.
        self._exec_lock = threading.Lock()
        self._cv = threading.Condition()
        # Notified after every settled batch (see _OpFuture).
        self._done_cv = threading.Condition(threading.Lock())
        self._backlog: deque[Request] = deque()
        # Threads blocked on a result, polls (flush() calls) so far and the last one the engine
        # saw (all under _cv), and the signal that ends the engine's cycle wait early.
        self._waiters = 0
        self._flushes = 0
        self._flushes_seen = 0
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
        counter = self._counters.get(op)
        if counter is None:
            with self._names_lock:
                counter = self._counters.setdefault(op, itertools.count())
        return f"{op}.noname.{next(counter)}"  # next() on a count is atomic

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
        request.future = _OpFuture(self)
        if blocking and not self._backlog:
            # Waiting for the lock is no worse than waiting for the engine thread to run it.
            with self._exec_lock:
                if not self._backlog:  # only this lock's holder takes requests out
                    self._run([request])
                    return request.future
        request.queued_ns = time.perf_counter_ns()
        with self._cv:
            self._backlog.append(request)
            self._cv.notify()
        return request.future

    def flush(self) -> None:
        """End the current cycle wait: negotiate what is queued now."""
        with self._cv:
            self._flushes += 1
        self._urgent.set()

    def _waiting(self, delta: int) -> None:
        with self._cv:
            self._waiters += delta
        if delta > 0:
            self._urgent.set()

    def _run_until(self, future: Future[Any]) -> None:
        """Run queued ops in this thread, in order, until ``future`` is done.

        When another thread is running ops, this one waits for the lock (no worse than waiting
        for the future) and then finds the future done or runs the next ops itself.
        """
        while not future.done():
            with self._exec_lock:
                if future.done() or self._run_next() == 0:
                    return

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread after the queued ops; False when it did not stop within ``timeout``."""
        if self._closed:
            return True
        self._closed = True
        with self._cv:
            self._cv.notify_all()
        self._urgent.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._backlog and not self._closed:
                    self._cv.wait()
                if not self._backlog:
                    return
            waited_for = self._cycle_wait()
            with self._cv:
                head = self._backlog[0] if self._backlog else None
            if head is None or (waited_for is not None and head is not waited_for):
                continue  # a waiter ran it meanwhile: the new head gets its own cycle
            with self._exec_lock:
                with self._cv:
                    current = self._backlog[0] if self._backlog else None
                if current is head:  # else a waiter ran it while this thread waited for the lock
                    self._run_next()

    def _run_next(self) -> int:
        """Run the next batch of the backlog (the caller holds ``_exec_lock``); how many ran."""
        with self._cv:
            if not self._backlog:
                return 0
            batch = self._batch(self._backlog)
        done = 1
        try:
            done = self._run(batch)
        finally:
            with self._cv:
                for _ in range(done):
                    self._backlog.popleft()
        return done

    def _cycle_wait(self) -> Request | None:
        """While the head's batch could still grow, wait until no op came for a cycle time.

        Returns the head it waited for (None when it did not wait).
        """
        if self.cycle_time <= 0:
            return None
        waited_for = None
        while True:
            with self._cv:
                if not self._backlog or not self._can_grow(self._backlog):
                    return waited_for
                head, last = self._backlog[0], self._backlog[-1]
                # Clear first, then look: a waiter or poll arriving after the look sets it.
                self._urgent.clear()
                hurry = self._waiters > 0 or self._flushes != self._flushes_seen or self._closed
                self._flushes_seen = self._flushes
            if waited_for is not None and head is not waited_for:
                return waited_for  # a waiter ran it meanwhile
            remaining = last.queued_ns / 1e9 + self.cycle_time - time.perf_counter()
            if hurry or remaining <= 0:
                return waited_for
            waited_for = head
            self._urgent.wait(remaining)

    def _batch(self, pending: deque[Request]) -> list[Request]:
        """The head and the queued requests right behind it that it may be fused with."""
        head = pending[0]
        fusion = head.fusion
        batch = [head]
        if fusion is None or self.fusion_threshold <= 0:
            return batch
        total = fusion.nbytes
        for request in itertools.islice(pending, 1, neg.MAX_SLOTS):
            other = request.fusion
            if other is None or other.key != fusion.key:
                break
            if total + other.nbytes > self.fusion_threshold:
                break
            batch.append(request)
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
        with self._done_cv:  # one wake-up for the whole batch
            self._done_cv.notify_all()
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
