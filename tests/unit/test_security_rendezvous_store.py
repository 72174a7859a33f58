"""The driver-kept rendezvous store (issue 27 item 9): torch Store semantics, signed access only.

Real RpcServer on 127.0.0.1, real torch Store calls; the end-to-end "a process without the
secret cannot reach a run()'s rendezvous" test is tests/integration/test_security_rendezvous.py.
"""

from __future__ import annotations

import datetime
import threading

import pytest

from spark_estimators.driver.kvstore import RendezvousKV
from spark_estimators.driver.rpc import RpcClient, RpcServer
from spark_estimators.errors import RpcError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

SECRET = b"k" * 32


@pytest.fixture
def server():
    kv = RendezvousKV()
    srv = RpcServer(SECRET, lambda kind, data, conn: kv.handle(data))
    try:
        yield srv, kv
    finally:
        srv.close()


def _store(srv, namespace="ns", timeout=5.0):
    from spark_estimators.driver.store_client import driver_store

    return driver_store(RpcClient(srv.address, SECRET), namespace, timeout)


def test_same_answers_as_torchs_own_store(server):
    srv, _ = server
    ours, ref = _store(srv), dist.HashStore()
    for store in (ours, ref):
        store.set("a", b"1")
        store.set("s", "text")
    assert ours.get("a") == ref.get("a") == b"1"
    assert ours.get("s") == ref.get("s") == b"text"
    assert ours.add("n", 5) == ref.add("n", 5) == 5
    assert ours.add("n", -2) == ref.add("n", -2) == 3
    assert ours.compare_set("a", b"1", b"2") == ref.compare_set("a", b"1", b"2") == b"2"
    assert ours.compare_set("a", b"x", b"3") == ref.compare_set("a", b"x", b"3") == b"2"
    assert ours.compare_set("new", b"", b"v") == ref.compare_set("new", b"", b"v") == b"v"
    assert ours.check(["a", "n"]) is ref.check(["a", "n"]) is True
    assert ours.check(["a", "zz"]) is ref.check(["a", "zz"]) is False
    assert ours.num_keys() == ref.num_keys() == 4
    assert ours.delete_key("a") is ref.delete_key("a") is True
    assert ours.delete_key("a") is ref.delete_key("a") is False
    prefixed = dist.PrefixStore("p", ours)
    prefixed.set("k", b"v")
    assert ours.get("p/k") == b"v"


def test_get_blocks_until_another_thread_sets(server):
    srv, _ = server
    reader, writer = _store(srv), _store(srv)
    got: list[bytes] = []
    started = threading.Event()

    def read() -> None:
        started.set()
        got.append(reader.get("late"))

    t = threading.Thread(target=read)
    t.start()
    started.wait()
    writer.set("late", b"here")
    t.join(10)
    assert got == [b"here"]


def test_wait_times_out_naming_the_keys(server):
    srv, _ = server
    store = _store(srv)
    with pytest.raises(RuntimeError, match="missing-key"):
        store.wait(["missing-key"], datetime.timedelta(seconds=0.2))


def test_namespaces_are_separate(server):
    srv, _ = server
    a, b = _store(srv, "job-a"), _store(srv, "job-b")
    a.set("k", b"a")
    assert b.check(["k"]) is False


def test_no_access_without_the_secret(server):
    srv, kv = server
    _store(srv).set("addr/0", b"10.0.0.1:1234")
    with pytest.raises(RpcError), RpcClient(srv.address, b"x" * 32) as intruder:
        intruder.call("store", ("list_keys", "ns", ()))
    with pytest.raises(RpcError), RpcClient(srv.address, b"x" * 32) as intruder:
        intruder.call("store", ("set", "ns", ("addr/0", b"6.6.6.6:1")))
    assert kv._spaces["ns"] == {"addr/0": b"10.0.0.1:1234"}
