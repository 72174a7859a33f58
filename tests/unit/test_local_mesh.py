"""The same-host negotiation transport (spark_estimators/collective/backends/local_mesh.py).

Real sockets: ranks are threads of this process meeting in one ``torch.distributed.HashStore``
(whose ``get`` waits for the key, as the job's store does), or forked processes meeting in a
TCPStore on 127.0.0.1 where a rank must really die.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from spark_estimators.collective.backends import local_mesh
from spark_estimators.collective.backends.local_mesh import LocalMesh

dist = pytest.importorskip("torch.distributed")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not local_mesh.sys.platform.startswith("linux"), reason="Linux only"),
]


def _store() -> Any:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    return store


def _on_ranks(size: int, body: Callable[[int, Any], Any], store: Any = None) -> list[Any]:
    """Run ``body(rank, store)`` on ``size`` threads; return the results, raise the first error."""
    store = store if store is not None else _store()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, store)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _connect(rank: int, store: Any, size: int, timeout: float = 20.0) -> LocalMesh | None:
    return LocalMesh.connect(store, rank, size, timeout=timeout, start_timeout=20.0)


@pytest.fixture(params=["spin", "sleep"])
def waiting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of waiting for a round: polling without sleeping first, or sleeping at once."""
    monkeypatch.setenv("SPARK_ESTIMATORS_MESH_SPIN_US", "300" if request.param == "spin" else "0")
    return str(request.param)


def test_spin_by_default_only_where_the_ranks_have_a_core_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPARK_ESTIMATORS_MESH_SPIN_US", raising=False)
    monkeypatch.setattr(local_mesh, "usable_cores", lambda: 2.0)
    assert local_mesh.spin_seconds(2) == pytest.approx(local_mesh.SPIN_US * 1e-6)
    assert local_mesh.spin_seconds(3) == 0.0  # a spinning rank would take a waited-for rank's core
    monkeypatch.setattr(local_mesh, "usable_cores", lambda: 1.5)  # a cgroup quota of 1.5 CPUs
    assert local_mesh.spin_seconds(2) == 0.0
    monkeypatch.setenv("SPARK_ESTIMATORS_MESH_SPIN_US", "50")  # the user's choice wins
    assert local_mesh.spin_seconds(8) == pytest.approx(50e-6)
    monkeypatch.setenv("SPARK_ESTIMATORS_MESH_SPIN_US", "0")
    assert local_mesh.spin_seconds(1) == 0.0
    monkeypatch.setenv("SPARK_ESTIMATORS_MESH_SPIN_US", "fast")
    with pytest.raises(Exception, match="SPARK_ESTIMATORS_MESH_SPIN_US"):
        local_mesh.spin_seconds(2)


def test_a_spin_that_runs_out_makes_the_next_rounds_sleep_at_once() -> None:
    mesh = LocalMesh(0, 2, {}, timeout=1.0)
    mesh.spin = 300e-6

    def pattern(rounds: int) -> list[bool]:
        return [mesh._spinning() for _ in range(rounds)]

    assert pattern(3) == [True] * 3  # spins that pay keep spinning
    mesh._spun(missed=True)
    assert pattern(3) == [False, False, True]
    mesh._spun(missed=True)  # the second in a row: twice as many rounds asleep
    assert pattern(5) == [False] * 4 + [True]
    mesh._spun(missed=False)  # a spin that paid: spinning again every round
    assert pattern(2) == [True, True]
    for _ in range(10):  # runs out again and again: at most 64 rounds asleep
        mesh._spun(missed=True)
    assert pattern(65) == [False] * 64 + [True]
    mesh.spin = 0.0
    assert pattern(2) == [False, False]


def test_usable_cores_is_at_most_the_affinity() -> None:
    cores = local_mesh.usable_cores()
    assert 0 < cores <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_allgather_returns_every_ranks_vector_in_rank_order(size: int, waiting: str) -> None:
    lengths = [5, 40_000, 3]  # 40k int64 = 320 KB: more than a socket buffer, sent in parts

    def body(rank: int, store: Any) -> list[np.ndarray]:
        mesh = _connect(rank, store, size)
        assert mesh is not None
        try:
            return [
                mesh.allgather(np.arange(n, dtype=np.int64) * (rank + 1) + i)
                for i, n in enumerate(lengths)
            ]
        finally:
            mesh.close()

    results = _on_ranks(size, body)
    for rank_result in results:
        for i, (n, rows) in enumerate(zip(lengths, rank_result, strict=True)):
            want = np.stack([np.arange(n) * (r + 1) + i for r in range(size)])
            np.testing.assert_array_equal(rows, want)


def test_rounds_of_different_lengths_raise_out_of_step() -> None:
    def body(rank: int, store: Any) -> str:
        mesh = _connect(rank, store, 2)
        assert mesh is not None
        try:
            mesh.allgather(np.zeros(4 if rank == 0 else 6, dtype=np.int64))
        except ConnectionError as exc:
            return str(exc)
        finally:
            mesh.close()
        return "no error"

    messages = _on_ranks(2, body)
    assert all("out of step" in m for m in messages), messages
    assert "rank 1 sent round 1 with 48 bytes" in messages[0]


def test_a_silent_peer_times_out_naming_it(waiting: str) -> None:
    def body(rank: int, store: Any) -> str:
        mesh = _connect(rank, store, 2, timeout=0.5)
        assert mesh is not None
        if rank == 1:
            store.wait(["done"])  # never gathers; closes after rank 0 gave up
            mesh.close()
            return ""
        start = time.monotonic()
        try:
            with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not exchange") as info:
                mesh.allgather(np.ones(3, dtype=np.int64))
            return f"{time.monotonic() - start:.2f} {info.value}"
        finally:
            store.set("done", "1")
            mesh.close()

    waited = float(_on_ranks(2, body)[0].split()[0])
    assert 0.4 <= waited < 5.0


def test_a_dead_peer_fails_the_round_at_once(waiting: str) -> None:
    """A forked rank exits mid-job: the other rank's round fails now, not after the timeout."""
    import multiprocessing

    server = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=20), False)
    ctx = multiprocessing.get_context("fork")

    def child() -> None:
        store = dist.TCPStore("127.0.0.1", server.port, 2, False, datetime.timedelta(seconds=20))
        mesh = _connect(1, store, 2)
        assert mesh is not None
        mesh.allgather(np.full(2, 7, dtype=np.int64))
        os._exit(0)  # the kernel closes its sockets

    proc = ctx.Process(target=child)
    proc.start()
    mesh = _connect(0, server, 2, timeout=60.0)
    assert mesh is not None
    np.testing.assert_array_equal(mesh.allgather(np.arange(2, dtype=np.int64)), [[0, 1], [7, 7]])
    proc.join(20)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="rank 1 closed its local mesh connection"):
        mesh.allgather(np.arange(2, dtype=np.int64))
    assert time.monotonic() - start < 5.0  # the collective timeout here is 60 s
    mesh.close()


def test_one_rank_that_cannot_connect_turns_the_mesh_off_everywhere() -> None:
    """Rank 0 publishes a name nobody listens on (as across network namespaces)."""
    store = _store()
    real_set = store.set

    class Store:
        def set(self, key: str, value: Any) -> None:
            if key == "spark_estimators/mesh/0":
                value = "spark-estimators-mesh-nobody:" + "00" * 16
            real_set(key, value)

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    results = _on_ranks(3, lambda rank, _: _connect(rank, Store(), 3))
    assert results == [None, None, None]


def test_a_hello_without_the_token_is_refused() -> None:
    import socket

    store = _store()
    stranger_done = threading.Event()

    def stranger() -> None:
        name, _ = store.get("spark_estimators/mesh/0").decode().rsplit(":", 1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + name)
        sock.sendall(local_mesh._HELLO.pack(1, b"\0" * 16))
        stranger_done.set()
        sock.recv(1)  # closed by rank 0
        sock.close()

    threading.Thread(target=stranger, daemon=True).start()

    def body(rank: int, shared: Any) -> list[list[int]]:
        if rank == 1:
            stranger_done.wait(20)  # the forged hello is queued first
        mesh = _connect(rank, shared, 2)
        assert mesh is not None
        try:
            return mesh.allgather(np.array([rank, 10 + rank], dtype=np.int64)).tolist()
        finally:
            mesh.close()

    assert _on_ranks(2, body, store) == [[[0, 10], [1, 11]]] * 2


def test_enabled_only_for_several_ranks_all_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARK_ESTIMATORS_LOCAL_MESH", raising=False)
    assert local_mesh.enabled(2, 2)
    assert not local_mesh.enabled(1, 1)  # nobody to talk to
    assert not local_mesh.enabled(4, 2)  # two hosts (or a host-hash salt)
    monkeypatch.setenv("SPARK_ESTIMATORS_LOCAL_MESH", "0")
    assert not local_mesh.enabled(2, 2)


def _silent_connection(store: Any, connected: threading.Event, done: threading.Event) -> None:
    """Connect to rank 0's mesh socket first and say nothing until ``done``."""
    import socket

    name, _ = store.get("spark_estimators/mesh/0").decode().rsplit(":", 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + name)
        connected.set()
        done.wait(60)


def test_a_silent_connection_is_dropped_and_the_mesh_still_forms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before issue 40 it held rank 0 until the start timeout, then a bare TimeoutError."""
    monkeypatch.setattr(local_mesh, "HELLO_TIMEOUT_S", 0.5)
    store = _store()
    connected, done = threading.Event(), threading.Event()
    threading.Thread(target=_silent_connection, args=(store, connected, done), daemon=True).start()

    def body(rank: int, shared: Any) -> list[list[int]]:
        if rank == 1:
            connected.wait(20)  # the silent connection is queued first
        mesh = _connect(rank, shared, 2)
        assert mesh is not None
        try:
            return mesh.allgather(np.array([rank], dtype=np.int64)).tolist()
        finally:
            mesh.close()

    try:
        assert _on_ranks(2, body, store) == [[[0], [1]]] * 2
    finally:
        done.set()


def test_a_mesh_not_accepted_in_time_is_dropped_on_every_rank() -> None:
    """The fallback: every rank gets None (the backend gathers), no rank raises."""
    store = _store()
    connected, done = threading.Event(), threading.Event()
    threading.Thread(target=_silent_connection, args=(store, connected, done), daemon=True).start()

    def body(rank: int, shared: Any) -> LocalMesh | None:
        if rank == 1:
            connected.wait(20)
        return LocalMesh.connect(shared, rank, 2, timeout=20.0, start_timeout=0.5)

    try:
        assert _on_ranks(2, body, store) == [None, None]
    finally:
        done.set()


def _message(payload: np.ndarray) -> memoryview:
    raw = bytearray(local_mesh.HEADER_BYTES + payload.nbytes)
    raw[local_mesh.HEADER_BYTES :] = payload.tobytes()
    return memoryview(raw)


@pytest.mark.parametrize("size", [2, 3])
def test_exchange_delivers_every_ranks_bytes_between_negotiation_rounds(
    size: int, waiting: str
) -> None:
    """Raw rounds (the optimizer's steady state) and vector rounds share one numbering."""

    def body(rank: int, store: Any) -> tuple[list[bool], np.ndarray, np.ndarray]:
        mesh = _connect(rank, store, size)
        assert mesh is not None
        try:
            oks, rows = [], np.zeros((size, 40_000), dtype=np.float32)
            for i in range(3):
                data = np.full(40_000, 10.0 * rank + i, dtype=np.float32)  # 160 KB
                into = {p: memoryview(rows[p]).cast("B") for p in range(size) if p != rank}
                oks.append(mesh.exchange(7, _message(data), into))
            gathered = mesh.allgather(np.array([rank, 5], dtype=np.int64))
            return oks, rows.copy(), gathered
        finally:
            mesh.close()

    for rank, (oks, rows, gathered) in enumerate(_on_ranks(size, body)):
        assert oks == [True, True, True]
        for peer in range(size):
            if peer != rank:  # the last round's bytes of every peer, in its row
                np.testing.assert_array_equal(rows[peer], np.full(40_000, 10.0 * peer + 2))
        np.testing.assert_array_equal(gathered, [[r, 5] for r in range(size)])


def test_a_rank_that_negotiates_voids_the_raw_round_on_every_rank() -> None:
    """Rank 2 negotiates (e.g. it called join()) while ranks 0, 1 send raw data: their exchange
    returns False, rank 2's allgather runs again and meets their next vectors; no mixing."""

    def body(rank: int, store: Any) -> object:
        mesh = _connect(rank, store, 3)
        assert mesh is not None
        try:
            vector = np.array([rank, 100 + rank], dtype=np.int64)
            if rank == 2:
                return mesh.allgather(vector)
            rows = np.zeros((3, 1000), dtype=np.uint8)
            into = {p: memoryview(rows[p]) for p in range(3) if p != rank}
            ok = mesh.exchange(9, _message(np.full(1000, rank + 1, dtype=np.uint8)), into)
            return ok, mesh.allgather(vector)  # the fallback: a negotiated round
        finally:
            mesh.close()

    results = _on_ranks(3, body)
    want = [[r, 100 + r] for r in range(3)]
    for ok, gathered in results[:2]:
        assert ok is False
        np.testing.assert_array_equal(gathered, want)
    np.testing.assert_array_equal(results[2], want)


def test_raw_rounds_with_different_tags_are_void_and_the_mesh_stays_in_step() -> None:
    def body(rank: int, store: Any) -> tuple[bool, bool]:
        mesh = _connect(rank, store, 2)
        assert mesh is not None
        try:
            rows = np.zeros((2, 64), dtype=np.uint8)
            into = {1 - rank: memoryview(rows[1 - rank])}
            length = 64 if rank == 0 else 32  # another bucket: another tag and length
            first = mesh.exchange(3 + rank, _message(np.ones(length, np.uint8)), into)
            second = mesh.exchange(3, _message(np.full(64, rank, np.uint8)), into)
            assert rows[1 - rank].tolist() == [1 - rank] * 64
            return first, second
        finally:
            mesh.close()

    assert _on_ranks(2, body) == [(False, True), (False, True)]


def test_same_tag_with_another_length_raises_out_of_step() -> None:
    def body(rank: int, store: Any) -> str:
        mesh = _connect(rank, store, 2)
        assert mesh is not None
        rows = np.zeros((2, 64), dtype=np.uint8)
        length = 64 if rank == 0 else 32
        try:
            into = {1 - rank: memoryview(rows[1 - rank])[:length]}
            mesh.exchange(5, _message(np.ones(length, np.uint8)), into)
        except ConnectionError as exc:
            return str(exc)
        finally:
            mesh.close()
        return "no error"

    messages = _on_ranks(2, body)
    assert all("out of step" in m for m in messages), messages


def test_a_void_raw_tag_backs_off_for_the_same_rounds_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``due(tag)``: after a void round, the tag waits BACKOFF mesh rounds on every rank (also
    the rank that only negotiated), doubling for a void in a row; a taken round resets it."""
    monkeypatch.setattr(local_mesh, "BACKOFF", 4)

    def body(rank: int, store: Any) -> list[object]:
        mesh = _connect(rank, store, 3)
        assert mesh is not None
        vector = np.array([rank], dtype=np.int64)
        rows = np.zeros((3, 8), dtype=np.uint8)
        into = {p: memoryview(rows[p]) for p in range(3) if p != rank}
        seen: list[object] = []

        def void_round() -> None:  # ranks 0, 1 try tag 9; rank 2 negotiates (e.g. joined)
            if rank < 2:
                seen.append(mesh.exchange(9, _message(np.ones(8, np.uint8)), into))
            mesh.allgather(vector)  # the fallback; rank 2's runs the void round again
            seen.append(mesh.due(9))

        def wait() -> None:  # negotiated rounds until tag 9 is due again
            waited = 0
            while not mesh.due(9):
                mesh.allgather(vector)
                waited += 1
            seen.append(waited)

        try:
            void_round()
            wait()
            void_round()  # a void in a row: twice the wait
            wait()
            seen.append(mesh.exchange(9, _message(np.full(8, rank, np.uint8)), into))
            seen.append(mesh.due(9))
            void_round()  # after a taken round: the first wait again
            wait()
            seen.append(mesh.due(7))  # another tag was never void
            return seen
        finally:
            mesh.close()

    results = _on_ranks(3, body)
    # ranks 0, 1: (exchange, due) per void round, the wait, ...; rank 2 has no failed exchange
    assert results[0] == results[1] == [False, False, 4, False, False, 8, True, True,
                                        False, False, 4, True]  # fmt: skip
    assert results[2] == [False, 4, False, 8, True, True, False, 4, True]
