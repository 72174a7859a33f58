"""Issue 27 items 10 and 12: a fit that lost its run lock stops writing; dead local owners.

Real LocalStore, real rank-like processes (the store pickled as the ranks get it), a
controllable clock instead of waiting out the stale timeout. Before the fix the paused owner's
ranks kept writing the run after another fit took it over, and a lock of a killed process on
this host blocked the run for the whole stale timeout.
"""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
import time

import pytest

from spark_estimators._base.liveness import host_id
from spark_estimators.errors import RunInUseError
from spark_estimators.store import LocalStore
from spark_estimators.store.lock import LockInfo, RunLock, lock_path

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

_RANK_WRITES = r"""
import pickle, sys
store, path = pickle.loads(sys.stdin.buffer.read())
try:
    store.write_bytes(path, b"from the stale fit")
    print("written")
except Exception as exc:
    print("refused", type(exc).__name__, exc)
"""


def _rank_write(store_bytes: bytes) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _RANK_WRITES],
        input=store_bytes,
        capture_output=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.decode().strip()


def _later(seconds: float):
    return lambda: time.time() + seconds


def test_paused_owner_stops_writing_after_a_takeover(tmp_path):
    root = str(tmp_path / "store")
    store_a = LocalStore(root)
    # A "paused" owner: its heartbeat would come only in an hour.
    lock_a = RunLock(store_a, "run_p", stale_after=60, heartbeat_every=3600)
    lock_a.acquire()
    ckpt = store_a.get_checkpoint_path("run_p") + "/checkpoint.json"
    store_a.write_bytes(ckpt, b"epoch 1 of fit A")
    shipped = pickle.dumps((store_a, ckpt))  # what fit A's ranks hold
    assert _rank_write(shipped) == "written"  # while A owns the run, its ranks write

    # Fit B, in another driver, sees A's heartbeat 61 s old and takes the run over.
    store_b = LocalStore(root)
    lock_b = RunLock(store_b, "run_p", stale_after=60, clock=_later(61))
    lock_b.acquire()
    try:
        store_b.write_bytes(ckpt, b"epoch 1 of fit B")
        # A's ranks, still running, must not write B's run again.
        refused = _rank_write(shipped)
        assert refused.startswith("refused RunInUseError"), refused
        assert "no longer owns the run" in refused and "run_p" in refused
        assert store_b.read_bytes(ckpt) == b"epoch 1 of fit B"
        # A's driver wakes up: its heartbeat notices, and its own writes fail without a read.
        assert lock_a.beat() is False and lock_a.lost
        with pytest.raises(RunInUseError, match="no longer owns the run"):
            store_a.write_bytes(ckpt, b"driver of fit A")
        lock_a.release()  # leaves B's lock alone
        held = LockInfo.from_bytes(store_b.read_bytes(lock_path(store_b, "run_p")))
        assert held is not None and held.token == lock_b.info.token
        # B's own writes go on.
        store_b.write_bytes(ckpt, b"epoch 2 of fit B")
        assert store_b.read_bytes(ckpt) == b"epoch 2 of fit B"
    finally:
        lock_b.release()


def test_a_fit_that_lost_its_lock_fails_when_its_body_ends(tmp_path):
    root = str(tmp_path / "store")
    lock_a = RunLock(LocalStore(root), "run_q", stale_after=60, heartbeat_every=3600)
    taker = RunLock(LocalStore(root), "run_q", stale_after=60, clock=_later(61))
    beats: list[bool] = []

    def fit_a() -> None:
        with lock_a.held():
            taker.acquire()  # another fit takes the run while A's body runs
            beats.append(lock_a.beat())

    with pytest.raises(RunInUseError, match="lost the run's lock"):
        fit_a()
    assert beats == [False]
    taker.release()


def test_a_released_lock_does_not_fence_later_writes(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    with RunLock(store, "run_r", stale_after=60).held():
        pass
    path = store.get_checkpoint_path("run_r") + "/checkpoint.json"
    store.write_bytes(path, b"after the fit")  # no lock held: no fence
    assert store.read_bytes(path) == b"after the fit"


_HOLDER = r"""
import sys
from spark_estimators.store import LocalStore
from spark_estimators.store.lock import RunLock
lock = RunLock(LocalStore(sys.argv[1]), "run_k", stale_after=60)
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_lock_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    root = str(tmp_path / "store")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        # While the owner lives, its fresh lock is respected.
        with pytest.raises(RunInUseError, match="in use by another fit"):
            RunLock(LocalStore(root), "run_k", stale_after=60).acquire()
        holder.kill()
        holder.wait(30)
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(LocalStore(root), "run_k", stale_after=60)
    with caplog.at_level(logging.WARNING, logger="spark_estimators.store.lock"):
        lock.acquire()  # before the fix: RunInUseError for 60 s
    try:
        assert any("no longer runs on this host" in r.getMessage() for r in caplog.records)
        held = LockInfo.from_bytes(LocalStore(root).read_bytes(lock_path(lock.store, "run_k")))
        assert held is not None and held.token == lock.info.token
    finally:
        lock.release()


def test_same_host_name_in_another_pid_namespace_is_not_judged_dead(tmp_path):
    # A container sharing the host's name has its own pids: its owner's pid means nothing here.
    store = LocalStore(str(tmp_path / "store"))
    now = time.time()
    gone_pid = 2**22 + 12345  # above pid_max's default: no such process here
    import socket

    other = LockInfo("run_c", "c:1:x", socket.gethostname(), gone_pid, "t", now, now, "other/ns")
    store.write_bytes(lock_path(store, "run_c"), other.to_bytes())
    with pytest.raises(RunInUseError):
        RunLock(store, "run_c", stale_after=60).acquire()
    same = LockInfo("run_d", "c:1:x", socket.gethostname(), gone_pid, "t", now, now, host_id())
    store.write_bytes(lock_path(store, "run_d"), same.to_bytes())
    lock = RunLock(store, "run_d", stale_after=60)
    lock.acquire()  # same kernel and pid namespace, no such pid: taken over at once
    lock.release()


def test_locks_written_before_host_id_still_parse():
    old = {"run_id": "r", "owner": "h:1:t", "host": "h", "pid": 1, "token": "t",
           "started": 1.0, "heartbeat": 2.0}  # fmt: skip
    info = LockInfo.from_bytes(json.dumps(old).encode())
    assert info is not None and info.host_id == "" and info.heartbeat == 2.0
