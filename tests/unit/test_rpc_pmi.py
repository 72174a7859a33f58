"""The PMI-1 server's network limits: unidentified connections are bounded, timed and quiet.

MPICH's PMI protocol cannot carry the driver service's handshake, so the PMI server applies the
same limits (``SPARK_ESTIMATORS_RPC_*``) to connections that have not sent a valid ``initack``.
The limits are set through the environment, so these tests also ran against the server before
the limits existed, where each failed (idle and drip-fed connections were kept forever, and every
refused ``PMI_ID`` logged a WARNING).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from spark_estimators.driver.pmi import PMIServer, parse_command

pytestmark = pytest.mark.timeout(60)

AUTH_S = 0.5
MAX_PENDING = 4


@pytest.fixture
def limited(monkeypatch):
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_AUTH_TIMEOUT", str(AUTH_S))
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED", str(MAX_PENDING))
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_LOG_INTERVAL", "3600")


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def _initack(server: PMIServer, rank: int) -> tuple[str, dict[str, str]]:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(f"cmd=initack pmiid={server.rank_env(rank)['PMI_ID']}\n".encode())
        return parse_command(sock.makefile("r").readline())


def test_idle_connections_are_bounded_and_dropped(limited):
    with PMIServer(2) as pmi:
        idle = [socket.create_connection((pmi.host, pmi.port), timeout=5) for _ in range(12)]
        try:
            t0 = time.monotonic()
            closed = [_closed_by_server(s, 5.0) for s in idle]
            waited = time.monotonic() - t0
        finally:
            for s in idle:
                s.close()
        assert all(closed), f"{closed.count(False)} idle PMI connection(s) kept open"
        assert waited < AUTH_S + 4
        # The ranks still get in afterwards.
        assert _initack(pmi, 0) == ("initack", {"rc": "0"})
        assert pmi.refusals.counts["busy"] == 12 - MAX_PENDING
        assert pmi.refusals.counts["initack timed out"] == MAX_PENDING


def test_drip_fed_initack_does_not_extend_the_deadline(limited):
    with PMIServer(1) as pmi:
        sock = socket.create_connection((pmi.host, pmi.port), timeout=5)
        stop = threading.Event()

        def drip() -> None:
            for ch in b"cmd=initack pmiid=" + b"1" * 200:
                if stop.wait(0.05):
                    return
                try:
                    sock.sendall(bytes([ch]))
                except OSError:
                    return

        t = threading.Thread(target=drip)
        t.start()
        try:
            assert _closed_by_server(sock, AUTH_S + 4), "a drip-fed connection was kept open"
        finally:
            stop.set()
            t.join(5)
            sock.close()
        assert _initack(pmi, 0) == ("initack", {"rc": "0"})


def test_refused_pmi_ids_are_logged_once_per_interval(limited, caplog):
    caplog.set_level(logging.WARNING, logger="spark_estimators.driver.pmi")
    with PMIServer(2) as pmi:
        for guess in range(1, 31):
            with socket.create_connection((pmi.host, pmi.port), timeout=5) as sock:
                sock.sendall(f"cmd=initack pmiid={guess}\n".encode())
                reply = parse_command(sock.makefile("r").readline())
                assert reply[0] == "initack" and reply[1]["rc"] == "-1"
        during = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(during) == 1, during
        assert _initack(pmi, 1) == ("initack", {"rc": "0"})
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2, lines
    assert sum(int(re.search(r"refused (\d+) conn", m).group(1)) for m in lines) == 30
    assert "unknown or reused PMI_ID" in lines[-1]
