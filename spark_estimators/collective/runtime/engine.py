"""The collective engine: one background thread per process that runs every collective op.

Why a thread: asynchronous ops (``allreduce_async_`` from gradient hooks) must run while the
caller keeps computing, and running every op in submission order keeps the order of ops
identical on all ranks, which collectives need. A *blocking* op submitted while nothing is
queued runs directly in the caller's thread (under the same execution lock), which saves two
thread hand-offs; a thread that waits for a queued op (``synchronize``) runs the queue up to it.
A submission wakes a parked engine thread only when it has no timer (nothing was submitted in
the last ``LINGER_S``) or the oldest queued op has waited a cycle; else the thread looks every
``LINGER_S``: a burst its caller waits for never wakes it (that cost ~0.2 ms a burst, GIL).

Negotiation (how mismatches become errors instead of hangs): before each op the ranks allgather
a small int64 vector (:mod:`.negotiation`): op kind, a hash of the op's signature (name, dtype,
shapes, reduction, root, scale factors), and what a joined rank needs to take part. If the
non-joined ranks disagree, every rank learns it from the same gathered vectors, all exchange
readable descriptions in one more round and raise
:class:`~spark_estimators.errors.CollectiveError` naming the tensor and each rank's view of it;
the group stays usable. A small CPU allreduce travels inside that allgather (*inline*, reduced
locally in rank order): one round trip instead of two; the room (up to
``SPARK_ESTIMATORS_INLINE_LIMIT``) follows the recent rounds, computed from the vectors only.
A batch of allreduces negotiated before runs again from the response cache (:mod:`.cache`):
one round of the local mesh under the batch's tag instead of the negotiation.

Fusion (Horovod's tensor fusion and cycle time): while the oldest queued op is an allreduce
whose batch could still grow, the engine thread waits until no new op has come for
``cycle_time`` (``SPARK_ESTIMATORS_CYCLE_TIME`` / ``HOROVOD_CYCLE_TIME``, ms, default 1), or
less as soon as someone waits for a result or polls one (a burst of per-parameter submissions,
longer than a cycle in Python, stays one round). Then it negotiates the head op with the
allreduces queued behind it that share its dtype, device, reduction and scaling, up to the
fusion threshold (``SPARK_ESTIMATORS_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``, bytes,
default 128 MiB; 0: no fusion), and runs the prefix every rank listed identically as one
reduction of one packed buffer. The order must be the same on every rank (unlike Horovod's
coordinator); a different order fails with the mismatch error instead of hanging.

Join: a rank that called ``join()`` keeps negotiating; while others still run allreduces it
contributes zeros (``Average`` still divides by ``size()``, as in Horovod) and barriers pass.
Other ops raise on the non-joined ranks. ``join()`` returns the rank that joined last.

Failures: an exception from the backend (a peer died, the collective timeout passed) fails the
op with :class:`CollectiveError` and marks the group broken; later ops fail at once.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from spark_estimators.collective.backends.base import Backend
from spark_estimators.collective.runtime import failures, settings
from spark_estimators.collective.runtime import negotiation as neg
from spark_estimators.collective.runtime.cache import ResponseCache
from spark_estimators.collective.runtime.futures import OpFuture
from spark_estimators.collective.runtime.requests import (
    JOINABLE,
    Agreement,
    Kind,
    Request,
    Tuner,
    claim_name,
)
from spark_estimators.collective.runtime.timeline import Timeline
from spark_estimators.errors import CollectiveError, ConfigurationError, SparkEstimatorsError

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
#: Seconds a parked engine thread sleeps at most while ops keep coming (see Engine._park).
LINGER_S = 0.02


class _Recoverable(SparkEstimatorsError):
    """Raised by negotiation when every rank fails the op the same way; the group survives."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


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
        # The names of the ops submitted and not settled yet (under _cv): a second op with the
        # name of one in flight is refused, as Horovod does (its *_duplicate_name_error tests).
        self._in_flight: set[str] = set()
        #: What repeated allreduces of one kind share (see allreduce.allreduce_one).
        self.statics: dict[tuple[object, ...], object] = {}
        # Held while ops run (engine thread or caller). Submitted ops wait in _backlog, in
        # submission order; only the holder of _exec_lock takes them out, from the front.
        self._exec_lock = threading.Lock()
        self._queue_lock = threading.RLock()  # _cv's: submit() takes it without the Condition
        self._cv = threading.Condition(self._queue_lock)
        # Notified after every settled batch (see futures.OpFuture).
        self._done_cv = threading.Condition(threading.Lock())
        self._backlog: deque[Request] = deque()
        # Under _cv: the engine thread sleeps on _cv (_idle; _deep: with no timer, see _park),
        # when an op was last queued, batches run so far and whether one runs now.
        self._idle = self._deep = self._running = False
        self._last_queued_ns = self._batches = 0
        # Threads blocked on a result, polls (flush() calls) so far and the last one the engine
        # saw (all under _cv), and the signal that ends the engine's cycle wait early.
        self._waiters = self._flushes = self._flushes_seen = 0
        self._urgent = threading.Event()
        self._negotiation = neg.Negotiation(settings.inline_limit(backend.size))
        #: Seconds a fusable op may wait in the queue for more to fuse with (the cycle time).
        self.cycle_time = settings.cycle_time() / 1000.0
        #: Most bytes one fused allreduce reduces (0: no fusion).
        self.fusion_threshold = settings.fusion_threshold()
        #: The process set this engine serves (0: the global set).
        self.set_id = 0
        #: The :class:`~.timeline.Timeline` recording the ops, or None.
        self.timeline: Timeline | None = None
        self.tuner: Tuner | None = None  #: autotune (:mod:`.autotune`) while it tunes
        #: Batches negotiated before, run again without negotiation (:mod:`.cache`), or None.
        self.cache = ResponseCache(backend) if ResponseCache.wanted(backend) else None

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
        if not request.settles_itself:
            request.future = OpFuture(self)
        if blocking and not self._backlog:
            # Waiting for the lock is no worse than waiting for the engine thread to run it.
            with self._exec_lock:
                if not self._backlog:  # only this lock's holder takes requests out
                    with self._cv:
                        claim_name(self._in_flight, request)
                        self._running = True
                    try:
                        self._run([request])  # never raises
                    finally:
                        with self._cv:
                            self._ran_batch()
                    return request.future
        request.queued_ns = now = time.perf_counter_ns()
        with self._queue_lock:
            claim_name(self._in_flight, request)
            backlog = self._backlog
            backlog.append(request)
            self._last_queued_ns = now
            # A parked engine thread is woken only when it has no timer or the oldest op has
            # waited a cycle (see the module's doc); a busy one looks when its wait ends.
            if self._idle and (self._deep or now - backlog[0].queued_ns >= self.cycle_time * 1e9):
                self._idle = False
                self._cv.notify()
        return request.future

    def flush(self) -> None:
        """End the current cycle wait: negotiate what is queued now."""
        with self._cv:
            self._flushes += 1
            self._wake()  # a parked engine thread too (see _loop)
        self._urgent.set()

    def _waiting(self, delta: int) -> None:
        with self._cv:
            self._waiters += delta
            self._wake()
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

    def run_exclusive(
        self, fn: Callable[[], _T], failed: Callable[[BaseException], CollectiveError]
    ) -> _T | None:
        """Call ``fn()`` in this thread with the group to itself, after every op submitted before.

        For exchanges outside the engine's ops (the optimizer's steady state over the local
        mesh). None, without calling ``fn``, when the group is broken (the engine's path raises
        why). An exception from ``fn`` breaks the group: ``failed(exc)`` is raised instead.
        """
        with self._exec_lock:
            try:
                while self._backlog:  # the ops submitted before run first, in order
                    self._run_next()
                if self._broken is not None:
                    return None
                try:
                    return fn()
                except Exception as exc:
                    error = self._broken = failed(exc)
                    raise error from exc
            finally:
                with self._cv:
                    self._ran_batch()  # a parked engine thread runs what came meanwhile

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
                    self._park()
                if not self._backlog:
                    return
            waited_for = self._cycle_wait()
            with self._cv:
                head = self._backlog[0] if self._backlog else None
                seen = self._batches
            if head is None or (waited_for is not None and head is not waited_for):
                continue  # a waiter ran it meanwhile: the new head gets its own cycle
            if not self._exec_lock.acquire(blocking=False):
                # A waiter runs ops in its thread: rather than wake as it lets go of the lock (a
                # GIL switch against it), sleep until ops are left or come (see _wake).
                with self._cv:
                    parked = self._batches == seen and not self._closed
                    if parked:
                        self._park()
                if parked:
                    continue
                self._exec_lock.acquire()
            try:
                with self._cv:
                    current = self._backlog[0] if self._backlog else None
                if current is head:  # else a waiter ran it while this thread waited for the lock
                    self._run_next()
            finally:
                self._exec_lock.release()

    def _park(self) -> None:
        """Sleep (under _cv) until woken, or for ``LINGER_S`` while ops keep coming.

        A batch that leaves ops, a waiter, a poll, stop() and a submission (module doc) wake it.
        """
        self._idle = True
        self._deep = time.perf_counter_ns() - self._last_queued_ns > LINGER_S * 1e9
        self._cv.wait(None if self._deep else LINGER_S)
        self._idle = False

    def _run_next(self) -> int:
        """Run the next batch of the backlog (the caller holds ``_exec_lock``); how many ran."""
        with self._cv:
            if not self._backlog:
                return 0
            batch = neg.fusion_batch(self._backlog, self.fusion_threshold)
            self._running = True
        done = 1
        try:
            done = self._run(batch)
        finally:
            with self._cv:
                for _ in range(done):
                    self._backlog.popleft()
                self._ran_batch()
        return done

    def _ran_batch(self) -> None:
        """Count a batch run under ``_exec_lock``; wake a parked engine thread if ops are left."""
        self._batches += 1
        self._running = False
        self._wake()

    def _wake(self) -> None:
        """Wake the engine thread if it sleeps while ops are queued (under ``_cv``)."""
        if self._idle and self._backlog:
            self._idle = False
            self._cv.notify()

    def _cycle_wait(self) -> Request | None:
        """While the head's batch could still grow, wait until no op came for a cycle time.

        Returns the head it waited for (None when it did not wait). While a waiter runs a batch
        it sleeps until that batch ends and leaves ops: a timer woke it mid-batch (GIL).
        """
        if self.cycle_time <= 0:
            return None
        waited_for = None
        while True:
            with self._cv:
                if not self._backlog or not neg.can_grow(self._backlog, self.fusion_threshold):
                    return waited_for
                head, last = self._backlog[0], self._backlog[-1]
                if waited_for is not None and head is not waited_for:
                    return waited_for  # a waiter ran it meanwhile
                # Clear first, then look: a waiter or poll arriving after the look sets it.
                self._urgent.clear()
                hurry = self._waiters > 0 or self._flushes != self._flushes_seen or self._closed
                self._flushes_seen = self._flushes
                remaining = last.queued_ns / 1e9 + self.cycle_time - time.perf_counter()
                if remaining <= 0 and not hurry and self.cache is not None:
                    remaining += self.cache.patience(self._backlog, self.cycle_time)
                if hurry or remaining <= 0:
                    return waited_for
                waited_for = head
                if self._running:  # _ran_batch wakes it when the batch leaves ops
                    self._park()
                    continue
            self._urgent.wait(remaining)

    def _run(self, batch: list[Request]) -> int:
        """Negotiate ``batch`` and run the agreed part; settles those futures (never raises).

        Returns how many requests of ``batch`` (its first ones) were settled. (The MPI backend's
        watchdog finds the op it serves in this frame's ``request`` local.)
        """
        head = request = batch[0]
        if self._broken is not None:
            self._release(batch[:1])
            head.future.settle(None, failures.broken_error(head, self._broken, self.backend))
            return 1
        timeline, cache = self.timeline, None if self.tuner else self.cache
        times, ran = [time.perf_counter_ns()], batch[:1]
        round_ = self._round  # the same on every rank: see ResponseCache.learn
        results: Sequence[object] = []
        error: BaseException | None = None
        try:
            if head.kind is Kind.JOIN:
                timeline = None  # join() is not an op of the timeline
                mismatch = functools.partial(self._raise_mismatch, None)
                results = [neg.join_rounds(round_, self._negotiation, self._negotiate, mismatch,
                                           self.backend)]  # fmt: skip
            elif cache and (cached := cache.run(batch, round_)) is not None:
                ran, results = batch, cached
            else:
                count, agreement = self._negotiate_batch(batch, times)
                ran = batch[:count]
                results = self._execute(ran, agreement)
                if self.cache is not None:
                    self.cache.learn(ran, agreement, self._negotiation.agreed_limit, round_)
        except _Recoverable as exc:
            error = exc.error
        except (CollectiveError, ConfigurationError) as exc:
            error = exc
        except BaseException as exc:
            error = failures.backend_error(request, exc, self.backend)
            self._broken = error
        if timeline is not None:
            timeline.record_batch(ran, self.set_id, times, error)
        self._release(ran)  # before the futures settle: a waiter may reuse a name at once
        for i, settled in enumerate(ran):
            settled.future.settle(None if error is not None else results[i], error)
        with self._done_cv:  # one wake-up for the whole batch
            self._done_cv.notify_all()
        return len(ran)

    def _release(self, ran: list[Request]) -> None:
        with self._cv:
            in_flight = self._in_flight
            for request in ran:
                in_flight.discard(request.name)

    def _negotiate_batch(self, batch: list[Request], times: list[int]) -> tuple[int, Agreement]:
        """Agree on what runs this round (``times`` gets the negotiation's end, and 1 if inline)."""
        head = batch[0]
        vectors = self._negotiate(self._negotiation.vector(batch))
        active = neg.active_ranks(vectors)
        if not neg.agree(vectors, active):
            self._raise_mismatch(head, vectors)
        joined = [r for r in range(self.backend.size) if r not in active]
        if joined and head.kind not in JOINABLE:
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

    def _execute(self, ran: list[Request], agreement: Agreement) -> Sequence[object]:
        head = ran[0]
        if len(ran) == 1:
            return [head.execute(agreement)]
        assert head.fusion is not None
        return head.fusion.run(ran, agreement)

    def _negotiate(self, vector: np.ndarray) -> np.ndarray:
        self._round += 1
        tuner = self.tuner  # autotune: rank 0 publishes settings, all apply them this round
        vectors = self.backend.gather_vectors(vector if tuner is None else tuner.stamp(vector))
        self._negotiation.update(vectors)
        if tuner is not None:
            tuner.settle(self, vectors)
        return vectors

    def _raise_mismatch(self, request: Request | None, vectors: np.ndarray) -> None:
        """Every rank comes here from the same vectors: exchange descriptions, then raise."""
        mine = None if request is None else (request.kind.name.lower(), request.description)
        views = self.backend.allgather_object(mine)
        if request is None:  # a joined rank: nothing of its own failed
            return
        raise _Recoverable(neg.mismatch_error(request.name, views))


_engine: Engine | None = None
_engine_lock = threading.RLock()


def current() -> Engine | None:
    """The running engine, or None before ``init()``."""
    return _engine


def require(op: str, process_set: object = None) -> Engine:
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
