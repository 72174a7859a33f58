"""The driver service under attack from the network: memory, threads and logs stay bounded.

The server runs in its own process (so its RSS and thread count can be measured with psutil);
attackers are raw sockets on 127.0.0.1 that know the wire format but not the secret. The attacks
only use names the protocol module has always had (``MAGIC``, ``_HEADER``) and environment
variables by their literal names, so these tests also run against the pre-handshake protocol,
where each of them failed (see the test docstrings).
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from spark_estimators.driver.frames import _HEADER, MAGIC, new_secret
from spark_estimators.driver.rpc import RpcClient, RpcServer
from spark_estimators.errors import RpcError

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

AUTH_TIMEOUT_S = 1.0
MAX_UNAUTHENTICATED = 16
RSS_BOUND = 64 << 20
SETTLE_S = AUTH_TIMEOUT_S + 10.0  # how long the server may take to drop what it must drop

SERVER = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
from spark_estimators.driver.rpc import RpcServer
secret = bytes.fromhex(sys.stdin.readline().strip())
seen = []
def handler(kind, data, conn):
    if kind == "seen":
        return list(seen)
    if kind == "big":
        return b"x" * int(data)
    seen.append(data)
    return {"echo": data}
server = RpcServer(secret, handler)
print(server.address[1], flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.close()
"""


class ServerProcess:
    def __init__(self, tmp_path):
        self.secret = new_secret()
        env = dict(os.environ)
        env.update(
            SPARK_ESTIMATORS_RPC_AUTH_TIMEOUT=str(AUTH_TIMEOUT_S),
            SPARK_ESTIMATORS_RPC_FRAME_TIMEOUT="2",
            SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED=str(MAX_UNAUTHENTICATED),
            SPARK_ESTIMATORS_RPC_LOG_INTERVAL="3600",
        )
        self.stderr_path = tmp_path / "server.err"
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
        )
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(self.secret.hex().encode() + b"\n")
        self.popen.stdin.flush()
        self.address = ("127.0.0.1", int(self.popen.stdout.readline()))
        self.proc = psutil.Process(self.popen.pid)

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    def threads(self) -> int:
        return int(self.proc.num_threads())

    def call(self, kind: str, data: object = None) -> object:
        with RpcClient(self.address, self.secret, timeout=30) as client:
            return client.call(kind, data)

    def stop(self) -> str:
        """Stop the server (it logs its last refusal summary on close); returns its stderr."""
        if self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._err.close()
        return self.stderr_path.read_text()


@pytest.fixture
def served(tmp_path):
    server = ServerProcess(tmp_path)
    try:
        assert server.call("ping", "warm-up") == {"echo": "warm-up"}
        yield server
    finally:
        server.stop()


def until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def settled_threads(server: ServerProcess, baseline: int) -> int:
    until(lambda: server.threads() <= baseline, SETTLE_S)
    return server.threads()


def attacker(address) -> socket.socket:
    """A connection that reads the server's greeting (whatever it is) and has no secret."""
    sock = socket.create_connection(address, timeout=5)
    sock.settimeout(0.5)
    try:
        sock.recv(64)
    except OSError:
        pass
    return sock


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes ``sock`` within ``timeout`` seconds (reading what it sends)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server may already have dropped us: that is the point


def peak_rss_while(server: ServerProcess, done: Callable[[], bool], timeout: float) -> int:
    peak = server.rss()
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        peak = max(peak, server.rss())
        time.sleep(0.05)
    return max(peak, server.rss())


def test_claimed_frame_sizes_are_not_allocated_before_authentication(served):
    """Old protocol: each 8-byte header claiming ~1 GiB made the server allocate it (+3 GiB)."""
    base = served.rss()
    socks = [attacker(served.address) for _ in range(3)]
    for sock in socks:
        send_quietly(sock, _HEADER.pack(MAGIC, (1 << 30) - 64))
    # Served while the claims are open.
    assert served.call("ping", "during") == {"echo": "during"}
    closed: set[int] = set()

    def all_closed() -> bool:
        for i, sock in enumerate(socks):
            if i not in closed and closed_by_server(sock, 0.01):
                closed.add(i)
        return len(closed) == len(socks)

    peak = peak_rss_while(served, all_closed, SETTLE_S)
    for sock in socks:
        sock.close()
    assert peak - base < RSS_BOUND, f"RSS grew by {(peak - base) >> 20} MiB"
    assert len(closed) == len(socks), "the server kept unauthenticated connections open"
    assert served.call("ping", "after") == {"echo": "after"}


def _drip(sock: socket.socket, stop: threading.Event) -> None:
    """Send a frame one byte every 0.1 s until the server drops us or the test ends."""
    data = _HEADER.pack(MAGIC, 1000) + os.urandom(200)
    for i in range(len(data)):
        if stop.wait(0.1):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return


def test_half_sent_and_drip_fed_connections_are_dropped(served):
    """Old protocol: every half-sent frame kept a server thread forever."""
    baseline = served.threads()
    half = [attacker(served.address) for _ in range(10)]
    for i, sock in enumerate(half):
        # A few bytes of a header, or a header and part of its body.
        part = MAGIC[:2] if i % 2 else _HEADER.pack(MAGIC, 1000) + b"x" * 10
        send_quietly(sock, part)
    stop = threading.Event()
    drip = [attacker(served.address) for _ in range(6)]
    drippers = [threading.Thread(target=_drip, args=(s, stop), daemon=True) for s in drip]
    for t in drippers:
        t.start()
    try:
        assert served.call("ping", "during") == {"echo": "during"}
        # A drip-fed connection must not extend its deadline: all are closed within it.
        for sock in half + drip:
            assert closed_by_server(sock, SETTLE_S), "a half-sent connection was kept open"
    finally:
        stop.set()
        for t in drippers:
            t.join(5)
        for sock in half + drip:
            sock.close()
    assert settled_threads(served, baseline) <= baseline
    assert served.call("ping", "after") == {"echo": "after"}


def test_idle_connections_are_bounded_and_the_good_client_is_served(served):
    """Old protocol: 200 idle connections held 200 server threads forever."""
    baseline = served.threads()
    idle = [socket.create_connection(served.address, timeout=5) for _ in range(200)]
    try:
        # Excess connections are refused at once: never more handshakes than the limit.
        assert until(lambda: served.threads() <= baseline + MAX_UNAUTHENTICATED, 5.0)
        peak_threads = served.threads()
        assert served.call("ping", "during") == {"echo": "during"}
        peak_threads = max(peak_threads, served.threads())
    finally:
        for sock in idle:
            sock.close()
    assert peak_threads <= baseline + MAX_UNAUTHENTICATED + 1
    assert settled_threads(served, baseline) <= baseline
    assert served.call("ping", "after") == {"echo": "after"}
    warnings = [line for line in served.stop().splitlines() if line.startswith("WARNING")]
    # One line at the first refusal, one summary at close (the interval is an hour here).
    assert len(warnings) == 2, warnings
    refused = sum(int(m) for line in warnings for m in re.findall(r"refused (\d+) conn", line))
    # The 200 idle ones, plus the good client's retries while the server was busy.
    assert 200 <= refused < 260, warnings
    assert "busy" in warnings[-1] and "handshake timed out" in warnings[-1]


def test_refused_connections_are_logged_once_per_interval(monkeypatch, caplog):
    """Old protocol: one WARNING line per refused connection."""
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_LOG_INTERVAL", "3600")
    secret = new_secret()
    server = RpcServer(secret, lambda kind, data, conn: data)
    caplog.set_level(logging.WARNING, logger="spark_estimators.driver.rpc")
    try:
        for i in range(50):
            with RpcClient(server.address, new_secret(), timeout=10) as bad:
                with pytest.raises((RpcError, OSError)):
                    bad.call("ping", i)
        with RpcClient(server.address, secret, timeout=10) as good:
            assert good.call("ping", "served") == "served"
        during = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(during) == 1, [r.getMessage() for r in during]
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2, lines
    assert sum(int(re.search(r"refused (\d+) conn", m).group(1)) for m in lines) == 50
    assert "failed authentication" in lines[-1]
    assert server.refusals.counts["failed authentication"] == 50


class RecordingProxy:
    """Forwards one client connection to the server and records what the client sent."""

    def __init__(self, target):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.sent = bytearray()
        self._target = target
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self._target)
        back = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
        back.start()
        self._pump(client, upstream, True)
        back.join(5)
        client.close()
        upstream.close()

    def close(self) -> None:
        self._thread.join(5)
        self.listener.close()


def test_fuzz_random_oversized_truncated_replayed_slow_and_idle(served):
    """N attacks of every kind while a good client works: bounded memory and threads, no replay.

    Old protocol: the oversized claims raised the RSS by GiBs and the slow, truncated and idle
    connections kept their threads.
    """
    rng = random.Random(18)
    proxy = RecordingProxy(served.address)
    with RpcClient(proxy.address, served.secret, timeout=30) as recorded:
        for i in range(3):
            assert recorded.call("ping", f"recorded-{i}") == {"echo": f"recorded-{i}"}
    proxy.close()
    conversation = bytes(proxy.sent)
    assert len(conversation) > 3 * 32

    base_rss, baseline = served.rss(), served.threads()
    good_values: list[str] = []
    good_errors: list[BaseException] = []
    stop = threading.Event()

    def good_client() -> None:
        try:
            i = 0
            while not stop.is_set():
                value = f"good-{i}"
                if i % 10 == 0:  # new connections too, not only one made before the attack
                    assert served.call("ping", value) == {"echo": value}
                else:
                    assert client.call("ping", value) == {"echo": value}
                good_values.append(value)
                i += 1
        except BaseException as exc:  # reported below
            good_errors.append(exc)

    client = RpcClient(served.address, served.secret, timeout=30)
    worker = threading.Thread(target=good_client)
    worker.start()
    held: list[socket.socket] = []
    drip_stop = threading.Event()
    drippers = []
    peak = base_rss
    try:
        for i in range(300):
            mode = i % 6
            sock = attacker(served.address)
            if mode == 0:  # random bytes
                send_quietly(sock, os.urandom(rng.randint(1, 300)))
            elif mode == 1:  # oversized claim, kept open
                send_quietly(sock, _HEADER.pack(MAGIC, rng.randint(1 << 29, (1 << 30) - 64)))
                held.append(sock)
            elif mode == 2:  # truncated well-framed body
                body = os.urandom(rng.randint(30, 300))
                frame = _HEADER.pack(MAGIC, len(body)) + body + os.urandom(32)
                send_quietly(sock, frame[: rng.randint(1, len(frame) - 1)])
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # already dropped (e.g. refused while the server was busy)
            elif mode == 3:  # a recorded conversation, replayed
                send_quietly(sock, conversation)
            elif mode == 4:  # slow: drip-fed, kept open
                drippers.append(threading.Thread(target=_drip, args=(sock, drip_stop)))
                drippers[-1].start()
                held.append(sock)
            else:  # idle, kept open
                held.append(sock)
            if mode in (0, 2, 3):
                closed_by_server(sock, 2.0)
                sock.close()
            if i % 20 == 0:
                peak = max(peak, served.rss())
        # The held connections must all be dropped by the server, with memory bounded meanwhile.
        peak = max(
            peak, peak_rss_while(served, lambda: all(closed_by_server(s, 0.01) for s in held), 30)
        )
        assert all(closed_by_server(s, 0.01) for s in held), "attack connections were kept open"
    finally:
        drip_stop.set()
        for t in drippers:
            t.join(5)
        for sock in held:
            sock.close()
        stop.set()
        worker.join(60)
        client.close()
    assert not good_errors, good_errors
    assert len(good_values) >= 10
    assert peak - base_rss < RSS_BOUND, f"RSS grew by {(peak - base_rss) >> 20} MiB"
    assert settled_threads(served, baseline) <= baseline
    # The replays did nothing: each recorded call was handled exactly once.
    seen = served.call("seen")
    assert isinstance(seen, list)
    assert [v for v in seen if str(v).startswith("recorded-")] == [
        f"recorded-{i}" for i in range(3)
    ]
    assert [v for v in seen if str(v).startswith("good-")] == good_values
    # A large authenticated reply still works after the attack.
    assert served.call("big", 8 << 20) == b"x" * (8 << 20)


def test_limits_from_env_are_checked(monkeypatch):
    from spark_estimators.driver.limits import RpcLimits

    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_AUTH_TIMEOUT", "2.5")
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED", "7")
    limits = RpcLimits.from_env()
    assert (limits.auth_timeout, limits.max_unauthenticated) == (2.5, 7)
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_FRAME_TIMEOUT", "0")
    with pytest.raises(ValueError, match="SPARK_ESTIMATORS_RPC_FRAME_TIMEOUT"):
        RpcLimits.from_env()
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_FRAME_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="'soon' is not a number"):
        RpcLimits.from_env()
