"""write_if_absent and the run lock, against every store kind (issue 18)."""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time

import pytest

from spark_estimators import envvars as ev
from spark_estimators.errors import ConfigurationError, RunInUseError
from spark_estimators.store.lock import LOCK_NAME, LockInfo, RunLock, lock_path, stale_after_s


def wait_until(condition, timeout=10.0):
    """Poll ``condition`` (a state we wait for, not a delay) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_write_if_absent_creates_once_and_keeps_the_first_content(store):
    path = store.get_run_path("r1") + "/marker"
    assert store.write_if_absent(path, b"first") is True
    assert store.write_if_absent(path, b"second") is False
    assert store.read_bytes(path) == b"first"
    assert not [n for n in store.listdir(store.get_run_path("r1")) if ".tmp-" in n]


def test_write_if_absent_has_one_winner_among_threads(store):
    path = store.get_run_path("race") + "/marker"
    wins: list[bytes] = []
    start = threading.Barrier(4)

    def contender(i):
        start.wait()
        if store.write_if_absent(path, f"owner-{i}".encode()):
            wins.append(f"owner-{i}".encode())

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.read_bytes(path) == wins[0]


def test_second_owner_fails_fast_naming_run_and_owner(store):
    first = RunLock(store, "run_a")
    first.acquire()
    try:
        info = LockInfo.from_bytes(store.read_bytes(lock_path(store, "run_a")))
        assert info is not None and info.token == first.info.token and info.run_id == "run_a"
        started = time.monotonic()
        with pytest.raises(RunInUseError) as err:
            RunLock(store, "run_a").acquire()
        assert time.monotonic() - started < 5
        text = str(err.value)
        assert "run_id='run_a'" in text and first.info.owner in text
        assert "another run_id" in text and ev.RUN_LOCK_TIMEOUT in text
        assert err.value.run_id == "run_a" and err.value.owner == first.info.owner
        assert 0 <= err.value.heartbeat_age_s < 5
        # Another run of the same store is free.
        with RunLock(store, "run_b").held():
            pass
    finally:
        first.release()
    assert not store.exists(lock_path(store, "run_a"))
    with RunLock(store, "run_a").held():  # free again once released
        assert store.exists(lock_path(store, "run_a"))
    assert not store.exists(lock_path(store, "run_a"))


def test_lock_is_released_when_the_body_raises(store):
    with pytest.raises(KeyError), RunLock(store, "run_c").held():
        raise KeyError("boom")
    assert not store.exists(lock_path(store, "run_c"))


def test_stale_lock_is_taken_over_with_a_warning(store, caplog):
    old = time.time() - 3600
    planted = LockInfo("run_s", "deadhost:1:abc", "deadhost", 1, "tok", old, old)
    store.write_bytes(lock_path(store, "run_s"), planted.to_bytes())
    lock = RunLock(store, "run_s", stale_after=60)
    with caplog.at_level(logging.WARNING, logger="spark_estimators.store.lock"):
        lock.acquire()
    try:
        held = LockInfo.from_bytes(store.read_bytes(lock_path(store, "run_s")))
        assert held is not None and held.token == lock.info.token
        assert any("deadhost:1:abc" in r.getMessage() for r in caplog.records)
    finally:
        lock.release()
    assert not store.exists(lock_path(store, "run_s"))


def test_fresh_foreign_lock_is_not_taken_over(store):
    now = time.time()
    planted = LockInfo("run_f", "otherhost:7:def", "otherhost", 7, "tok", now - 5, now - 5)
    store.write_bytes(lock_path(store, "run_f"), planted.to_bytes())
    with pytest.raises(RunInUseError, match="otherhost:7:def"):
        RunLock(store, "run_f", stale_after=60).acquire()
    assert LockInfo.from_bytes(store.read_bytes(lock_path(store, "run_f"))) == planted


def test_heartbeat_is_refreshed_and_a_lost_lock_is_noticed(store):
    lock = RunLock(store, "run_h", stale_after=60, heartbeat_every=0.05)
    lock.acquire()
    try:
        path = lock_path(store, "run_h")
        first = LockInfo.from_bytes(store.read_bytes(path))
        assert first is not None

        def beaten():
            # s3: a heartbeat may replace the lock between read_bytes' open and GET (it reads again)
            info = LockInfo.from_bytes(store.read_bytes(path))
            return info is not None and info.heartbeat > first.heartbeat

        assert wait_until(beaten), "the heartbeat was never refreshed"
        thief = LockInfo("run_h", "thief:1:x", "thief", 1, "other", time.time(), time.time())
        store.write_bytes_atomic(path, thief.to_bytes())
        assert wait_until(lambda: lock.lost), "the lost lock was not noticed"
    finally:
        lock.release()
    # Not ours any more: release leaves the new owner's lock alone.
    assert json.loads(store.read_bytes(lock_path(store, "run_h")))["owner"] == "thief:1:x"


def test_stale_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv(ev.RUN_LOCK_TIMEOUT, raising=False)
    assert stale_after_s() == 60.0
    monkeypatch.setenv(ev.RUN_LOCK_TIMEOUT, "7.5")
    assert stale_after_s() == 7.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(ev.RUN_LOCK_TIMEOUT, bad)
        with pytest.raises(ConfigurationError, match=ev.RUN_LOCK_TIMEOUT):
            stale_after_s()


def test_run_in_use_error_survives_pickling():
    err = RunInUseError("msg", run_id="r", owner="h:1:t", heartbeat_age_s=2.5)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.run_id, back.owner, back.heartbeat_age_s) == ("msg", "r", "h:1:t", 2.5)


def test_lock_file_lives_in_the_run_dir(store):
    with RunLock(store, "run_l").held():
        assert store.listdir(store.get_run_path("run_l")) == [LOCK_NAME]
