"""The driver protocol refuses every bad frame and keeps serving good clients."""

from __future__ import annotations

import hmac
import os
import random
import socket
import struct
import threading

import pytest

from spark_estimators.driver.rpc import (
    _HEADER,
    MAGIC,
    NONCE_BYTES,
    TO_CLIENT,
    TO_SERVER,
    FrameCodec,
    RpcClient,
    RpcServer,
    new_secret,
)
from spark_estimators.errors import RpcError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    secret = new_secret()
    calls = []

    def handler(kind, data, conn):
        calls.append((kind, data))
        if kind == "boom":
            raise ValueError("handler says no")
        return {"echo": data, "kind": kind}

    srv = RpcServer(secret, handler)
    srv.calls = calls
    srv.secret = secret
    try:
        yield srv
    finally:
        srv.close()


def _raw(server) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(server.address, timeout=5)
    session = b""
    while len(session) < NONCE_BYTES:
        session += sock.recv(NONCE_BYTES - len(session))
    return sock, session


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
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


def test_wrong_key_rejected_and_nothing_unpickled(server):
    with RpcClient(server.address, new_secret()) as bad, pytest.raises((RpcError, OSError)):
        bad.call("ping", 1)
    assert server.calls == []
    assert server.rejected_frames == 1
    _good_roundtrip(server, "still serving")


def test_oversized_length_rejected_before_reading(server):
    sock, _ = _raw(server)
    # Claim a 4 GiB body but send nothing more: the server must refuse on the header alone.
    sock.sendall(_HEADER.pack(MAGIC, 0xFFFFFFFF))
    assert _closed_by_server(sock)
    sock.close()
    assert server.rejected_frames == 1
    _good_roundtrip(server, 2)


def test_truncated_frame_rejected(server):
    sock, _ = _raw(server)
    sock.sendall(_HEADER.pack(MAGIC, 100) + b"x" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert _closed_by_server(sock)
    sock.close()
    assert server.calls == []
    _good_roundtrip(server, 3)


def test_replayed_frame_rejected_on_same_and_new_connection(server):
    sock, session = _raw(server)
    codec = FrameCodec(server.secret, session, TO_SERVER, TO_CLIENT)
    frame = codec.encode("ping", "first")
    sock.sendall(frame)
    assert codec.read(sock) == ("ok", {"echo": "first", "kind": "ping"})
    # The same bytes again on the same connection: the sequence number is stale.
    sock.sendall(frame)
    assert _closed_by_server(sock)
    sock.close()
    # The same bytes on a new connection: another session nonce.
    sock2, _ = _raw(server)
    sock2.sendall(frame)
    assert _closed_by_server(sock2)
    sock2.close()
    assert [c[1] for c in server.calls] == ["first"]
    assert server.rejected_frames == 2
    _good_roundtrip(server, "after replay")


def test_reflected_server_frame_rejected(server):
    """A frame signed in the server-to-client direction is refused by the server."""
    sock, session = _raw(server)
    as_server = FrameCodec(server.secret, session, TO_CLIENT, TO_SERVER)
    sock.sendall(as_server.encode("ping", "reflected"))
    assert _closed_by_server(sock)
    sock.close()
    assert server.calls == []
    assert server.rejected_frames == 1


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
            # A well-formed, correctly-framed body with a MAC from the wrong key.
            body = b"\x01" + session + struct.pack("!Q", 0) + os.urandom(50)
            header = _HEADER.pack(MAGIC, len(body))
            data = header + body + hmac.new(b"k" * 32, header + body, "sha256").digest()
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
    assert server.rejected_frames == 1000
    _good_roundtrip(server, "alive")
