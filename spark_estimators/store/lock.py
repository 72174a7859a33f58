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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from spark_estimators import envvars as ev
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

    def to_bytes(self) -> bytes:
        """The lock as canonical JSON bytes."""
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @staticmethod
    def from_bytes(data: bytes) -> LockInfo | None:
        """The parsed lock, or None for content that is not a lock (empty, half-written)."""
        try:
            raw = json.loads(data.decode("utf-8"))
            return LockInfo(**{k: raw[k] for k in LockInfo.__dataclass_fields__})
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
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.path = lock_path(store, run_id)
        self.stale_after = stale_after if stale_after is not None else stale_after_s()
        self.heartbeat_every = (
            heartbeat_every
            if heartbeat_every is not None
            else min(MAX_HEARTBEAT_S, self.stale_after / 4)
        )
        host, pid, token = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        now = time.time()
        self.info = LockInfo(run_id, f"{host}:{pid}:{token[:8]}", host, pid, token, now, now)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False  # set when another owner replaced our lock while we held it

    # ------------------------------------------------------------------------ acquire/release
    def acquire(self) -> None:
        """Own the run, or raise :class:`RunInUseError` when a live fit owns it."""
        for _ in range(_TAKEOVER_ATTEMPTS):
            if self._try_create():
                self._start_heartbeat()
                return
            seen = self._read_raw()
            if seen is None:
                continue  # released in the meantime: try again
            current = LockInfo.from_bytes(seen)
            age = self._age(current)
            if age < self.stale_after:
                raise self._in_use(current, age)
            logger.warning(
                "run %r: taking over the lock of %s, whose last heartbeat is %.0fs old "
                "(stale after %gs; %s)",
                self.run_id,
                current.owner if current else "an unknown owner",
                age,
                self.stale_after,
                ev.RUN_LOCK_TIMEOUT,
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

    # --------------------------------------------------------------------------- internals
    def _try_create(self) -> bool:
        now = time.time()
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
            return max(0.0, time.time() - current.heartbeat)
        # Unreadable content (a lock being written by O_EXCL): judge by the file's age.
        try:
            mtime_ns = self.store.stat(self.path).mtime_ns
        except StoreError:
            return 0.0
        return 0.0 if mtime_ns is None else max(0.0, time.time() - mtime_ns / 1e9)

    def _in_use(self, current: LockInfo | None, age: float) -> RunInUseError:
        owner = current.owner if current is not None else "an unknown owner"
        since = "" if current is None else f", started {time.time() - current.started:.0f}s ago"
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
            try:
                current = LockInfo.from_bytes(self._read_raw() or b"")
                if current is None or current.token != self.info.token:
                    self.lost = True
                    logger.error(
                        "run %r: its lock %s was taken over by %s while this fit ran (no "
                        "heartbeat was written for %gs?); two fits may now write this run",
                        self.run_id,
                        self.path,
                        current.owner if current else "nobody",
                        self.stale_after,
                    )
                    return
                self.info = LockInfo(**{**asdict(self.info), "heartbeat": time.time()})
                self.store.write_bytes_atomic(self.path, self.info.to_bytes())
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the fit
                logger.warning("run %r: lock heartbeat failed: %s", self.run_id, exc)

    def _remove_empty_run_dir(self) -> None:
        """A fit that failed before writing anything leaves no empty run dir behind.

        Only where ``rmdir`` refuses a non-empty dir (local filesystems): a recursive delete
        could remove the lock another fit has just created in it. Object stores have no dirs.
        """
        if self.store._is_local():
            with contextlib.suppress(OSError):
                os.rmdir(self.store.fs_path(self.store.get_run_path(self.run_id)))


def hold_run(store: Any, run_id: str) -> Any:
    """Context manager: own ``run_id`` in ``store`` for the body (see :class:`RunLock`)."""
    return RunLock(store, run_id).held()
