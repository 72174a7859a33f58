"""One owner per run: a lock file in the run's directory of the store.

Two fits with the same ``run_id`` at the same time would write one checkpoint from two trainings
(and a later refit would resume from mixed weights). So a fit first creates
``runs/{run_id}/.run-lock.json`` with :meth:`~spark_estimators.store.StoreBase.write_if_absent`;
it holds the owner's id (host, pid and a random token), the time it started and a heartbeat that a
driver thread refreshes every few seconds. The file is removed when the fit ends, successfully or
not. A second fit that finds a lock with a fresh heartbeat fails at once with
:class:`~spark_estimators.errors.RunInUseError`, before any Spark job or data write. A lock whose
heartbeat is older than the stale timeout (``SPARK_ESTIMATORS_RUN_LOCK_TIMEOUT`` seconds, default
60: its owner was killed, or lost the store) is taken over with a warning.

Limits (documented in docs/reliability.md):

* Exclusive creation is atomic on local and mounted filesystems and on stores whose fsspec
  backend implements ``"xb"`` (s3fs on AWS S3); elsewhere (HDFS) it is a check followed by a
  write, and the content is read back to catch most races, not all.
* The heartbeat is wall-clock time of the owner's machine: drivers sharing a store need clocks
  that agree to well within the timeout.
* Taking over a stale lock deletes it only if it is unchanged since it was judged stale; two
  drivers taking over the same stale lock in the same instant is not excluded.

An owner that lost its lock stops before writing the run again. A fit paused past the stale
timeout (a suspended VM, a stopped driver) finds on waking that another fit took the run over;
its ranks keep running meanwhile. So the store object a fit locked carries a
:class:`RunFence` (it travels to the ranks with the store): every write or delete under the
run's directory first reads the lock and raises :class:`~spark_estimators.errors.RunInUseError`
when the lock is no longer this fit's; the driver's heartbeat marks the fence lost as soon as it
sees the takeover, and :meth:`RunLock.held` then fails the fit when its body ends. What remains
is the moment between that read and the write (a checkpoint written in the very instant of the
takeover); the next write of the stale fit fails.

A lock whose owner ran on this host (same host name, kernel boot and pid namespace) and whose
process no longer exists is taken over at once, without waiting for the stale timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from spark_estimators import envvars as ev
from spark_estimators._base.liveness import host_id, is_gone
from spark_estimators.errors import ConfigurationError, RunInUseError, StoreError
from spark_estimators.store.base import StoreBase, join_path

logger = logging.getLogger(__name__)

LOCK_NAME = ".run-lock.json"
DEFAULT_STALE_AFTER_S = 60.0
#: Heartbeats come at most this far apart (more often with a short stale timeout).
MAX_HEARTBEAT_S = 5.0
_TAKEOVER_ATTEMPTS = 3


def stale_after_s() -> float:
    """The stale timeout: ``SPARK_ESTIMATORS_RUN_LOCK_TIMEOUT`` seconds, default 60."""
    text = os.environ.get(ev.RUN_LOCK_TIMEOUT)
    if text is None or not text.strip():
        return DEFAULT_STALE_AFTER_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(
            f"{ev.RUN_LOCK_TIMEOUT}={text!r} is invalid: expected a number of seconds > 0 "
            f"(default {DEFAULT_STALE_AFTER_S:g})"
        )
    return value


@dataclass(frozen=True)
class LockInfo:
    """What a run's lock file holds."""

    run_id: str
    owner: str
    host: str
    pid: int
    token: str
    started: float
    heartbeat: float
    #: Kernel boot and pid namespace of the owner ("" where unknown): its pid means something
    #: here only when they equal ours (:func:`host_id`).
    host_id: str = ""

    def to_bytes(self) -> bytes:
        """The lock as canonical JSON bytes."""
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @staticmethod
    def from_bytes(data: bytes) -> LockInfo | None:
        """The parsed lock, or None for content that is not a lock (empty, half-written)."""
        try:
            raw = json.loads(data.decode("utf-8"))
            fields = LockInfo.__dataclass_fields__
            return LockInfo(**{k: raw[k] for k in fields if k in raw or k != "host_id"})
        except (ValueError, KeyError, TypeError):
            return None


def lock_path(store: StoreBase, run_id: str) -> str:
    """Where the lock of ``run_id`` lives: ``runs/{run_id}/.run-lock.json``."""
    return join_path(store.get_run_path(run_id), LOCK_NAME)


class RunLock:
    """The lock of one run, held by this process from :meth:`acquire` to :meth:`release`.

    Parameters
    ----------
    store
        The store that holds the run.
    run_id
        The run to own.
    stale_after
        Seconds without a heartbeat after which someone else's lock is taken over; default
        :func:`stale_after_s`.
    heartbeat_every
        Seconds between heartbeats; default ``min(5, stale_after / 4)``.
    clock
        Wall-clock time for heartbeats and ages (``time.time``; tests pass their own).

    Examples
    --------
    >>> with RunLock(store, "run_1").held():  # doctest: +SKIP
    ...     train()
    """

    def __init__(
        self,
        store: StoreBase,
        run_id: str,
        *,
        stale_after: float | None = None,
        heartbeat_every: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._clock = clock
        self.run_id = run_id
        self.path = lock_path(store, run_id)
        self.stale_after = stale_after if stale_after is not None else stale_after_s()
        self.heartbeat_every = (
            heartbeat_every
            if heartbeat_every is not None
            else min(MAX_HEARTBEAT_S, self.stale_after / 4)
        )
        host, pid, token = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        now = clock()
        owner = f"{host}:{pid}:{token[:8]}"
        self.info = LockInfo(run_id, owner, host, pid, token, now, now, host_id())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False  # set when another owner replaced our lock while we held it

    # ------------------------------------------------------------------------ acquire/release
    def acquire(self) -> None:
        """Own the run, or raise :class:`RunInUseError` when a live fit owns it."""
        for _ in range(_TAKEOVER_ATTEMPTS):
            if self._try_create():
                RunFence.of(self.store).hold(self.store, self.run_id, self.path, self.info.token)
                self._start_heartbeat()
                return
            seen = self._read_raw()
            if seen is None:
                continue  # released in the meantime: try again
            current = LockInfo.from_bytes(seen)
            age = self._age(current)
            dead = current is not None and _dead_here(current)
            if age < self.stale_after and not dead:
                raise self._in_use(current, age)
            logger.warning(
                "run %r: taking over the lock of %s, %s",
                self.run_id,
                current.owner if current else "an unknown owner",
                f"whose process {current.pid} no longer runs on this host"
                if dead and current is not None
                else f"whose last heartbeat is {age:.0f}s old (stale after "
                f"{self.stale_after:g}s; {ev.RUN_LOCK_TIMEOUT})",
            )
            if self._read_raw() == seen:  # delete only the lock judged stale, not a new one
                self.store.delete(self.path)
        raise RunInUseError(
            f"run_id={self.run_id!r}: could not take the run's lock at {self.path!r} in "
            f"{_TAKEOVER_ATTEMPTS} attempts; another fit is taking it at the same time. Use "
            "another run_id, or retry",
            run_id=self.run_id,
        )

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        fence = self.store.__dict__.get("_write_fence")
        if isinstance(fence, RunFence):
            fence.drop(self.run_id)
        try:
            current = LockInfo.from_bytes(self._read_raw() or b"")
            if current is not None and current.token == self.info.token:
                self.store.delete(self.path)
                self._remove_empty_run_dir()
        except StoreError as exc:
            logger.warning(
                "run %r: could not remove its lock %s (%s); the next fit takes it over "
                "once it is stale (%gs)",
                self.run_id,
                self.path,
                exc,
                self.stale_after,
            )

    @contextmanager
    def held(self) -> Iterator[RunLock]:
        """Acquire, yield, and release whatever happens in the body."""
        self.acquire()
        try:
            yield self
        finally:
            self.release()
        if self.lost:  # the body ended normally, but another fit owns the run now
            raise self._lost_error("ending the fit")

    def _lost_error(self, doing: str) -> RunInUseError:
        return RunInUseError(
            f"run_id={self.run_id!r}: this fit lost the run's lock {self.path!r} to another fit "
            f"while it ran (no heartbeat for {self.stale_after:g}s: the driver was paused or "
            f"lost the store); it stopped before {doing}. The run now belongs to the other fit; "
            f"refit with another run_id, or raise {ev.RUN_LOCK_TIMEOUT}",
            run_id=self.run_id,
        )

    # --------------------------------------------------------------------------- internals
    def _try_create(self) -> bool:
        now = self._clock()
        self.info = LockInfo(**{**asdict(self.info), "started": now, "heartbeat": now})
        data = self.info.to_bytes()
        if not self.store.write_if_absent(self.path, data):
            return False
        # Where creation is not exclusive (see write_if_absent), the last writer wins: read back.
        return self._read_raw() == data

    def _read_raw(self) -> bytes | None:
        try:
            return self.store.read_bytes(self.path)
        except StoreError:
            if not self.store.exists(self.path):
                return None
            raise

    def _age(self, current: LockInfo | None) -> float:
        if current is not None:
            return max(0.0, self._clock() - current.heartbeat)
        # Unreadable content (a lock being written by O_EXCL): judge by the file's age.
        try:
            mtime_ns = self.store.stat(self.path).mtime_ns
        except StoreError:
            return 0.0
        return 0.0 if mtime_ns is None else max(0.0, self._clock() - mtime_ns / 1e9)

    def _in_use(self, current: LockInfo | None, age: float) -> RunInUseError:
        owner = current.owner if current is not None else "an unknown owner"
        since = "" if current is None else f", started {self._clock() - current.started:.0f}s ago"
        return RunInUseError(
            f"run_id={self.run_id!r} is in use by another fit: {owner} holds its lock "
            f"{self.path!r} (last heartbeat {age:.1f}s ago{since}). Two fits on one run would "
            "write one checkpoint. Use another run_id, or wait until that fit ends; a lock "
            f"without a heartbeat for {self.stale_after:g}s ({ev.RUN_LOCK_TIMEOUT}) is taken over",
            run_id=self.run_id,
            owner=owner,
            heartbeat_age_s=age,
        )

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name=f"se-run-lock-{self.run_id}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_every):
            if not self.beat():
                return

    def beat(self) -> bool:
        """Refresh the heartbeat once; False (and :attr:`lost` set) when the lock is not ours.

        The heartbeat thread calls it every ``heartbeat_every`` seconds.
        """
        try:
            current = LockInfo.from_bytes(self._read_raw() or b"")
            if current is None or current.token != self.info.token:
                self.lost = True
                fence = self.store.__dict__.get("_write_fence")
                if isinstance(fence, RunFence):
                    fence.mark_lost(self.run_id)
                logger.error(
                    "run %r: its lock %s was taken over by %s while this fit ran (no "
                    "heartbeat was written for %gs?); this fit stops before writing the run "
                    "again",
                    self.run_id,
                    self.path,
                    current.owner if current else "nobody",
                    self.stale_after,
                )
                return False
            self.info = LockInfo(**{**asdict(self.info), "heartbeat": self._clock()})
            self.store.write_bytes_atomic(self.path, self.info.to_bytes())
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the fit
            logger.warning("run %r: lock heartbeat failed: %s", self.run_id, exc)
        return True

    def _remove_empty_run_dir(self) -> None:
        """A fit that failed before writing anything leaves no empty run dir behind.

        Only where ``rmdir`` refuses a non-empty dir (local filesystems): a recursive delete
        could remove the lock another fit has just created in it. Object stores have no dirs.
        """
        if self.store._is_local():
            with contextlib.suppress(OSError):
                os.rmdir(self.store.fs_path(self.store.get_run_path(self.run_id)))


def _dead_here(info: LockInfo) -> bool:
    """True when the lock's owner ran in this kernel and pid namespace and its process is gone.

    (Same host name alone is not enough: containers sharing the host's name have their own
    pids.)
    """
    return info.host == socket.gethostname() and is_gone(info.host_id, info.pid)


class RunFence:
    """Refuses writes under a run whose lock this store's fit no longer holds.

    Kept on the store object (``store._write_fence``) a :class:`RunLock` was taken on, so it
    is pickled with the store to the ranks; :meth:`~spark_estimators.store.io.StoreIO.open_write`
    and ``delete`` call it with every path. For each run held: a write under the run's
    directory (other than the lock itself) reads the lock first and raises
    :class:`~spark_estimators.errors.RunInUseError` when another fit's token is in it.
    """

    def __init__(self) -> None:
        self.runs: dict[str, tuple[str, str, str]] = {}  # run_id -> (run dir, lock, token)
        self.lost: set[str] = set()

    @staticmethod
    def of(store: StoreBase) -> RunFence:
        """The store's fence, made on first use."""
        fence = store.__dict__.get("_write_fence")
        if not isinstance(fence, RunFence):
            fence = RunFence()
            store.__dict__["_write_fence"] = fence
        return fence

    def hold(self, store: StoreBase, run_id: str, path: str, token: str) -> None:
        """Fence ``run_id`` (its lock at ``path`` holds ``token``)."""
        run_dir = store.full_path(store.get_run_path(run_id)).rstrip("/") + "/"
        self.runs[run_id] = (run_dir, store.full_path(path), token)
        self.lost.discard(run_id)

    def drop(self, run_id: str) -> None:
        """Stop fencing ``run_id`` (its lock was released)."""
        self.runs.pop(run_id, None)
        self.lost.discard(run_id)

    def mark_lost(self, run_id: str) -> None:
        """The driver saw the takeover: refuse without reading the lock again."""
        self.lost.add(run_id)

    def __call__(self, store: StoreBase, path: str) -> None:
        """Raise RunInUseError when ``path`` is in a run that is no longer ours."""
        full = store.full_path(path)
        for run_id, (run_dir, lock, token) in list(self.runs.items()):
            if not full.startswith(run_dir) or full == lock:
                continue
            owner = "another fit"
            if run_id not in self.lost:
                try:
                    current = LockInfo.from_bytes(store.read_bytes(lock))
                except StoreError:
                    current = None  # deleted: taken over and released, or being replaced
                if current is not None and current.token == token:
                    continue
                owner = current.owner if current is not None else "nobody (lock removed)"
                self.lost.add(run_id)
            raise RunInUseError(
                f"run_id={run_id!r}: this fit no longer owns the run (its lock {lock!r} is "
                f"held by {owner}: its heartbeat stopped for longer than the stale timeout, "
                f"{ev.RUN_LOCK_TIMEOUT}, e.g. the driver was paused); refusing to write {path!r}. "
                "Refit with another run_id, or raise the timeout",
                run_id=run_id,
            )


def hold_run(store: StoreBase, run_id: str) -> contextlib.AbstractContextManager[RunLock]:
    """Context manager: own ``run_id`` in ``store`` for the body (see :class:`RunLock`)."""
    return RunLock(store, run_id).held()
