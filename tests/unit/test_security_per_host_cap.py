"""Issue 27 item 11: one address cannot hold every unauthenticated slot of the driver service.

Real server on 127.0.0.1; a second source address (127.0.0.2, also loopback) stands for another
host. Before the fix the third idle connection from 127.0.0.1 got the server's hello like any.
"""

from __future__ import annotations

import socket

import pytest

from spark_estimators.driver.frames import HELLO_BYTES, MAGIC, ConnectionClosed, _recv_exact
from spark_estimators.driver.limits import RpcLimits
from spark_estimators.driver.rpc import RpcClient, RpcServer

SECRET = b"c" * 32


def _idle(address, source="127.0.0.1"):
    """A connection that never authenticates; returns it and what the server said first."""
    sock = socket.create_connection(address, timeout=10, source_address=(source, 0))
    try:
        return sock, _recv_exact(sock, HELLO_BYTES)[: len(MAGIC)]
    except (OSError, ConnectionClosed) as exc:
        return sock, type(exc).__name__


@pytest.fixture
def server():
    limits = RpcLimits(max_unauthenticated=8, max_unauthenticated_per_host=2, auth_timeout=30)
    srv = RpcServer(SECRET, lambda kind, data, conn: data, limits=limits)
    try:
        yield srv
    finally:
        srv.close()


def test_one_address_gets_only_its_share(server):
    held = [_idle(server.address) for _ in range(2)]
    assert [greeting for _, greeting in held] == [MAGIC, MAGIC]
    third, greeting = _idle(server.address)
    assert greeting != MAGIC  # closed at once, before any hello
    assert server.refusals.counts["per-address cap"] == 1
    # Another address still gets in, and a client with the secret from there is served.
    other, greeting = _idle(server.address, source="127.0.0.2")
    assert greeting == MAGIC
    other.close()
    for sock in (third, *[s for s, _ in held]):
        sock.close()


def test_slots_come_back_when_the_handshakes_end(server):
    held = [_idle(server.address)[0] for _ in range(2)]
    for sock in held:
        sock.close()
    # The closed handshakes give their slots back (the server notices the EOF): a client with
    # the secret from the same address is served within its retry window.
    with RpcClient(server.address, SECRET, timeout=20) as client:
        assert client.call("echo", 42) == 42


def test_limit_is_validated():
    with pytest.raises(ValueError, match="max_unauthenticated_per_host"):
        RpcLimits(max_unauthenticated_per_host=0)
