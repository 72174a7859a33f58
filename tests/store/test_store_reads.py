"""Reading a store file that another writer replaces meanwhile (a run lock's heartbeat on S3).

An object store pins the version a read opened: s3fs raises ``FileExpired`` when the object was
replaced between the open and the GET. ``read_bytes`` reads such a file again; these tests put the
replacement exactly between the two, on the real S3-API server (moto) of tests/store/conftest.py.
"""

from __future__ import annotations

import pytest

from spark_estimators.errors import StoreError
from spark_estimators.store.io import _READ_ATTEMPTS
from spark_estimators.store.layout import join_path
from spark_estimators.store.lock import LockInfo, RunFence, lock_path


class _ReplacingFilesystem:
    """The store's own filesystem, but each of the first ``replace`` opens for reading is followed
    by a rewrite of the file (through the same filesystem) before the caller reads the stream."""

    def __init__(self, real, contents: list[bytes]) -> None:
        self.real, self.contents, self.opens = real, list(contents), 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def open_input_stream(self, path):
        self.opens += 1
        src = self.real.open_input_stream(path)
        if self.contents:
            with self.real.open_output_stream(path) as out:
                out.write(self.contents.pop(0))
        return src


#: tests/store/conftest.py's S3 store (moto on 127.0.0.1) only: a local file read keeps the inode it
#: opened, so nothing is replaced mid-read there.
pytestmark = pytest.mark.parametrize("store", ["s3"], indirect=True)


def test_a_file_replaced_between_open_and_read_is_read_again(store):
    store.write_bytes("lock.json", b"first version")
    fs = _ReplacingFilesystem(store.filesystem, [b"second version, longer"])
    store._fs = fs
    assert store.read_bytes("lock.json") == b"second version, longer"
    assert fs.opens == 2


def test_a_file_replaced_on_every_read_fails_after_the_attempts_naming_it(store):
    store.write_bytes("lock.json", b"v0")
    fs = _ReplacingFilesystem(store.filesystem, [b"v%d" % i for i in range(1, 10)])
    store._fs = fs
    with pytest.raises(StoreError, match=r"cannot read 'lock.json'.*no longer exists"):
        store.read_bytes("lock.json")
    assert fs.opens == _READ_ATTEMPTS == 3


def test_a_missing_file_is_not_read_again(store):
    fs = _ReplacingFilesystem(store.filesystem, [])
    store._fs = fs
    with pytest.raises(StoreError, match=r"cannot read 'absent.json'.*does not exist"):
        store.read_bytes("absent.json")
    assert fs.opens == 1


def test_the_run_fence_keeps_a_run_whose_lock_its_heartbeat_replaced_mid_read(store):
    """Before the retry, the fence took the failed read for a removed lock and refused the fit's
    own checkpoint write with RunInUseError ("nobody (lock removed)")."""
    lock = lock_path(store, "run-1")
    info = LockInfo("run-1", "us", "host", 1, "t-ours", started=1.0, heartbeat=1.0)
    store.write_bytes(lock, info.to_bytes())
    RunFence.of(store).hold(store, "run-1", lock, "t-ours")
    beat = LockInfo("run-1", "us", "host", 1, "t-ours", started=1.0, heartbeat=2.0)
    fs = _ReplacingFilesystem(store.filesystem, [beat.to_bytes()])
    store._fs = fs
    checkpoint = join_path(store.get_run_path("run-1"), "checkpoint.pt")
    store.write_bytes(checkpoint, b"weights")  # RunInUseError on a misread lock
    assert fs.opens == 2  # the fence read the lock, and read it again after the rewrite
    assert store.read_bytes(checkpoint) == b"weights"
    assert RunFence.of(store).lost == set()
