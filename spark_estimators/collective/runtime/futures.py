"""The futures of submitted collective ops.

:class:`Handle` is what the async API returns; :class:`OpFuture` is the engine's light
per-request future.

A future does not import the engine: it is handed the engine as an :class:`OpRunner`, the part of
:class:`~spark_estimators.collective.runtime.engine.Engine` that a waiting thread uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

logger = logging.getLogger("spark_estimators.collective.runtime.engine")

#: The result an op's handle resolves to.
_T = TypeVar("_T")

_PENDING, _RUNNING, _FINISHED = "PENDING", "RUNNING", "FINISHED"  # as Future names them


class OpRunner(Protocol):
    """What a waiting future needs of the engine (see :class:`_OpFuture`)."""

    _done_cv: threading.Condition

    def _run_until(self, future: Future[Any]) -> None: ...

    def _waiting(self, delta: int) -> None: ...

    def flush(self) -> None:
        """Run what is queued now instead of at the end of the cycle."""


class OpFuture(Future[Any]):
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

    def __init__(self, engine: OpRunner) -> None:  # no Future.__init__: no per-op Condition
        self._engine = engine
        self._state = _PENDING
        self._result: object = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[Any]], object]] | None = None

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
        callbacks = self._callbacks
        if callbacks is None:
            callbacks = self._callbacks = []
        callbacks.append(fn)
        if self._state == _FINISHED:
            try:
                callbacks.remove(fn)
            except ValueError:
                return  # _finish took it
            fn(self)

    def set_running_or_notify_cancel(self) -> bool:
        """Mark the op running (the engine calls it)."""
        self._state = _RUNNING
        return True

    def set_result(self, result: object) -> None:
        """Settle with ``result``; the engine wakes the waiters once per batch."""
        self._result = result
        self._finish()

    def set_exception(self, exception: BaseException | None) -> None:
        """Settle with an error; the engine wakes the waiters once per batch."""
        self._exception = exception
        self._finish()

    def settle(self, result: object, exception: BaseException | None) -> None:
        """Settle with ``result``, or ``exception`` when not None (the engine, in one call)."""
        self._result, self._exception = result, exception
        self._finish()

    def _finish(self) -> None:
        self._state = _FINISHED
        callbacks = self._callbacks
        while callbacks:
            try:
                fn = callbacks.pop(0)
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
        if self._state != _FINISHED:
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
        return f"<OpFuture {state}>"


class Handle:
    """An asynchronous op in flight; pass it to ``synchronize()`` or ``poll()``.

    What every async op returns: :class:`FuturesHandle` (one or more engine requests), or the
    request itself when one object is the op, its future and its handle (the per-tensor
    allreduce, :class:`~spark_estimators.collective.runtime.allreduce.AllreduceOp`).
    """

    __slots__ = ()
    name: str

    def wait(self) -> Any:
        """Block until the op finished and return its result (raises the op's error)."""
        raise NotImplementedError

    def done(self) -> bool:
        """True when the op has finished."""
        raise NotImplementedError

    def poll(self) -> bool:
        """True when the op has finished; else the engine is asked to run it soon."""
        raise NotImplementedError

    def then(self, fn: Callable[[_T], object]) -> Handle:
        """A handle of the same op whose :meth:`wait` returns ``fn`` of this one's result."""
        raise NotImplementedError


class FuturesHandle(Handle):
    """The :class:`Handle` of one or more engine requests (their futures).

    A grouped op with several dtypes is one request per dtype. ``finish`` runs in the caller's
    thread in :meth:`wait` and turns the list of request results into the op's return value
    (e.g. decompresses it).
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

    poll = done

    def wait(self) -> Any:
        """Block until the op finished and return its result (raises the op's error)."""
        futures = self._futures
        if len(futures) == 1:
            return self._result([futures[0].result()])
        return self._result([f.result() for f in futures])

    def then(self, fn: Callable[[_T], object]) -> Handle:
        """A handle of the same op whose :meth:`wait` returns ``fn`` of this one's result."""
        return FuturesHandle(self._futures, self.name, lambda results: fn(self._result(results)))

    def _result(self, results: list[object]) -> Any:
        if self._finish is not None:
            return self._finish(results)
        return results[0] if len(results) == 1 else results

    def __repr__(self) -> str:
        state = "done" if all(f.done() for f in self._futures) else "pending"
        return f"Handle({self.name!r}, {state})"
