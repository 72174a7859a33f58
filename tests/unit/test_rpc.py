"""The driver protocol refuses every bad frame and keeps serving good clients."""

from __future__ import annotations

import hmac
import os
import random
import socket
import threading
import time

import pytest

from spark_estimators.driver.frames import (
    _HEADER,
    AUTH_BYTES,
    HELLO_BYTES,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    TO_CLIENT,
    TO_SERVER,
    FrameCodec,
    client_auth,
    new_secret,
    session_id,
)
from spark_estimators.driver.limits import RpcLimits
from spark_estimators.driver.rpc import RpcClient, RpcServer
from spark_estimators.errors import RpcError

pytestmark = pytest.mark.timeout(60)


def _make_server(limits=None):
    secret = new_secret()
    calls = []

    def handler(kind, data, conn):
        calls.append((kind, data))
        if kind == "boom":
            raise ValueError("handler says no")
        if kind == "wait":
            release.wait(float(data))
            return "waited"
        return {"echo": data, "kind": kind}

    release = threading.Event()
    srv = RpcServer(secret, handler, limits=limits)
    srv.calls = calls
    srv.secret = secret
    srv.release = release
    return srv


@pytest.fixture
def server():
    srv = _make_server()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed early"
        data += chunk
    return data


def _raw(server) -> tuple[socket.socket, bytes]:
    """An unauthenticated connection and the server nonce from its greeting."""
    sock = socket.create_connection(server.address, timeout=5)
    hello = _recv(sock, HELLO_BYTES)
    assert hello[:4] == MAGIC
    return sock, hello[4:]


def _authenticated(server) -> tuple[socket.socket, bytes]:
    """A connection through the handshake by hand; returns it and its session bytes."""
    sock, ns = _raw(server)
    nc = os.urandom(NONCE_BYTES)
    sock.sendall(client_auth(server.secret, ns, nc))
    proof = _recv(sock, MAC_BYTES)
    assert proof == hmac.new(server.secret, b"se-server" + ns + nc, "sha256").digest()
    return sock, session_id(server.secret, ns, nc)


def _closed_by_server(sock: socket.socket, timeout: float = 5) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True


def _good_roundtrip(server, value) -> None:
    with RpcClient(server.address, server.secret) as client:
        assert client.call("ping", value) == {"echo": value, "kind": "ping"}


def test_roundtrip_and_handler_error(server):
    with RpcClient(server.address, server.secret) as client:
        for i in range(5):
            assert client.call("ping", i)["echo"] == i
        with pytest.raises(ValueError, match="handler says no"):
            client.call("boom")
        assert client.call("ping", "after")["echo"] == "after"
    assert server.refusals.total == 0


def test_wrong_key_refused_at_the_handshake_and_nothing_unpickled(server):
    with RpcClient(server.address, new_secret()) as bad, pytest.raises(RpcError, match="refused"):
        bad.call("ping", 1)
    assert server.calls == []
    assert server.refusals.counts == {"failed authentication": 1}
    _good_roundtrip(server, "still serving")


def _fake_server(proof: bytes | None):
    """A listener that greets like the driver but does not hold the secret.

    It answers the handshake with ``proof`` (None: never) and records every byte the client
    sends until the client hangs up.
    """
    fake = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def serve():
        conn, _ = fake.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
            if proof is not None:
                got.extend(_recv(conn, AUTH_BYTES))
                conn.sendall(proof)
            conn.settimeout(10)
            try:
                while chunk := conn.recv(1 << 16):
                    got.extend(chunk)
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return fake, t, got


@pytest.mark.parametrize("proof", [os.urandom(MAC_BYTES), None], ids=["forged-proof", "no-proof"])
def test_client_sends_no_request_byte_to_a_server_without_the_secret(proof):
    """Only the 52 handshake bytes reach a listener that cannot prove the secret."""
    fake, t, got = _fake_server(proof)
    want = "did not prove that it holds" if proof else "did not prove within 1s"
    with RpcClient(fake.getsockname()[:2], new_secret(), timeout=1.0) as client:
        with pytest.raises(RpcError, match=want):
            client.call("register", {"secret-looking": "x" * 100})
    t.join(10)
    fake.close()
    assert not t.is_alive()
    assert len(got) == AUTH_BYTES, f"the client sent {len(got) - AUTH_BYTES} request bytes"
    assert bytes(got[:4]) == MAGIC


def test_closed_server_stops_listening_and_ends_its_threads():
    """close() closes the port and joins the accept and connection threads (they leaked)."""
    # Threads of servers from earlier tests may still be ending: count only this server's.
    before = {t.ident for t in threading.enumerate()}
    srv = _make_server()
    client = RpcClient(srv.address, srv.secret)
    assert client.call("ping", 1)["echo"] == 1  # a connection thread is serving it now
    ours = [t for t in threading.enumerate() if t.ident not in before]
    assert sorted(t.name for t in ours) == ["se-rpc-accept", "se-rpc-conn"]
    srv.close()  # joins them (bounded)
    assert [t.name for t in ours if t.is_alive()] == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(srv.address, timeout=2).close()
    client.close()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before


def test_oversized_length_rejected_before_reading(server):
    sock, _ = _authenticated(server)
    # Claim a 4 GiB body but send nothing more: the server must refuse on the header alone.
    sock.sendall(_HEADER.pack(MAGIC, 0xFFFFFFFF))
    assert _closed_by_server(sock)
    sock.close()
    assert server.refusals.counts == {"bad frame": 1}
    _good_roundtrip(server, 2)


def test_truncated_frame_rejected(server):
    sock, _ = _authenticated(server)
    sock.sendall(_HEADER.pack(MAGIC, 100) + b"x" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert _closed_by_server(sock)
    sock.close()
    assert server.calls == []
    assert server.refusals.counts == {"truncated frame": 1}
    _good_roundtrip(server, 3)


def test_half_sent_frame_of_an_authenticated_peer_times_out():
    srv = _make_server(RpcLimits(frame_timeout=0.5))
    try:
        sock, _ = _authenticated(srv)
        sock.sendall(_HEADER.pack(MAGIC, 100) + b"x" * 10)  # and then nothing
        t0 = time.monotonic()
        assert _closed_by_server(sock, timeout=10)
        assert time.monotonic() - t0 < 5
        sock.close()
        assert srv.refusals.counts == {"frame timed out": 1}
        _good_roundtrip(srv, "after")
    finally:
        srv.close()


def test_authenticated_connections_may_idle_and_long_poll_past_the_frame_timeout():
    """The frame timeout counts from a frame's first byte: idle and long requests are fine."""
    srv = _make_server(RpcLimits(frame_timeout=0.2, auth_timeout=0.2))
    try:
        with RpcClient(srv.address, srv.secret) as client:
            assert client.call("ping", 1)["echo"] == 1
            # A long poll (the handler blocks 1 s, five frame timeouts) answers normally.
            assert client.call("wait", 1.0) == "waited"
            # Idle for longer than both timeouts, then the next call still works.
            srv.release.clear()
            threading.Event().wait(0.6)
            assert client.call("ping", 2)["echo"] == 2
        assert srv.refusals.total == 0
    finally:
        srv.close()


def test_replayed_frame_rejected_on_same_and_new_connection(server):
    sock, session = _authenticated(server)
    codec = FrameCodec(server.secret, session, TO_SERVER, TO_CLIENT)
    frame = codec.encode("ping", "first")
    sock.sendall(frame)
    assert codec.read(sock) == ("ok", {"echo": "first", "kind": "ping"})
    # The same bytes again on the same connection: the sequence number is stale.
    sock.sendall(frame)
    assert _closed_by_server(sock)
    sock.close()
    # The same bytes on a new authenticated connection: another session.
    sock2, _ = _authenticated(server)
    sock2.sendall(frame)
    assert _closed_by_server(sock2)
    sock2.close()
    assert [c[1] for c in server.calls] == ["first"]
    assert server.refusals.counts == {"bad frame": 2}
    _good_roundtrip(server, "after replay")


def test_replayed_handshake_refused(server):
    """A recorded handshake answer does not authenticate a new connection (fresh nonce)."""
    sock, ns = _raw(server)
    answer = client_auth(server.secret, ns, os.urandom(NONCE_BYTES))
    sock.sendall(answer)
    _recv(sock, MAC_BYTES)
    sock.close()
    sock2, _ = _raw(server)
    sock2.sendall(answer)
    assert _closed_by_server(sock2)
    sock2.close()
    assert server.refusals.counts == {"failed authentication": 1}


def test_reflected_server_frame_rejected(server):
    """A frame signed in the server-to-client direction is refused by the server."""
    sock, session = _authenticated(server)
    as_server = FrameCodec(server.secret, session, TO_CLIENT, TO_SERVER)
    sock.sendall(as_server.encode("ping", "reflected"))
    assert _closed_by_server(sock)
    sock.close()
    assert server.calls == []
    assert server.refusals.counts == {"bad frame": 1}


def test_random_garbage_frames_rejected_while_serving(server):
    rng = random.Random(1234)
    good_errors = []

    def good_client():
        try:
            with RpcClient(server.address, server.secret) as client:
                for i in range(200):
                    assert client.call("ping", i)["echo"] == i
        except Exception as exc:  # pragma: no cover - reported below
            good_errors.append(exc)

    t = threading.Thread(target=good_client)
    t.start()
    for i in range(1000):
        sock, session = _raw(server)
        mode = i % 4
        if mode == 0:
            data = os.urandom(rng.randint(1, 200))
        elif mode == 1:
            body = os.urandom(rng.randint(25, 300))
            data = _HEADER.pack(MAGIC, len(body)) + body + os.urandom(32)
        elif mode == 2:
            # A well-formed handshake answer made with the wrong key, then a frame.
            data = client_auth(b"k" * 32, session, os.urandom(NONCE_BYTES)) + os.urandom(80)
        else:
            data = _HEADER.pack(MAGIC, rng.randint(1 << 31, (1 << 32) - 1))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may already have dropped us: that is the point
        assert _closed_by_server(sock)
        sock.close()
    t.join(30)
    assert not good_errors
    assert server.calls and all(kind == "ping" for kind, _ in server.calls)
    assert server.refusals.total == 1000
    assert set(server.refusals.counts) <= {"failed authentication", "closed during handshake"}
    _good_roundtrip(server, "alive")
