"""The authenticated, signed, length-prefixed protocol between the driver service and the ranks.

Handshake, fixed sizes, on every connection (nothing of variable length is read before it)::

    server -> client   b"SEv2" | server nonce ns (16)                              20 bytes
    client -> server   b"SEv2" | client nonce nc (16) | HMAC(secret, "se-client"|ns|nc)  52 bytes
    server -> client   HMAC(secret, "se-server"|ns|nc)                              32 bytes

The server reads exactly 52 bytes from a new connection, within ``auth_timeout`` seconds in total
(a drip-fed handshake does not extend it), and closes it unless they start with the magic and the
MAC verifies. Only then may the peer send frames. The client sends nothing of a request before
the server's proof has arrived and verified: a listener that does not hold the secret (a port
taken over after the driver went, a wrong address) gets the 52 handshake bytes, which carry
nothing but a MAC over two random nonces, and the client raises :class:`RpcError`. The proof is
read on the first :meth:`RpcClient.call`, so a connection costs one round trip more than the
calls it makes (about 0.1 ms on 127.0.0.1) and later calls nothing.
At most ``max_unauthenticated`` connections may be in the handshake at once, and at most
``max_unauthenticated_per_host`` of them from one IP address; the server closes further ones at
once, and a client retries with backoff until its timeout.

The wire format of a frame is in :mod:`spark_estimators.driver.frames`.

A connection that sends anything wrong is closed; the server keeps serving its other clients.
When ``accept()`` itself fails (``EMFILE``: the driver ran out of file descriptors), the server
logs one WARNING, retries with a backoff of up to one second and serves the waiting connections
once descriptors are free again (:attr:`RpcServer.accept_errors` counts the failures).
Refused connections are counted (:attr:`RpcServer.refusals`) and logged as one WARNING per
``log_interval``, not one per connection. The limits come from :class:`RpcLimits`.

:meth:`RpcServer.close` (every job closes its server) stops accepting, closes the listening
socket and every connection, and joins the accept and connection threads (5 s at most): a
driver that runs hundreds of jobs keeps its threads, descriptors and ports flat
(``tests/integration/test_driver_leaks.py``).
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from spark_estimators import envvars as ev
from spark_estimators.driver.frames import (
    _HEADER,
    AUTH_BYTES,
    FRAME_MIN_RATE,
    HELLO_BYTES,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    TO_CLIENT,
    TO_SERVER,
    ConnectionClosed,
    DeadlineExceeded,
    FrameCodec,
    _recv_exact,
    client_auth,
    handshake_mac,
    session_id,
)
from spark_estimators.driver.limits import RefusalLog, RpcLimits
from spark_estimators.errors import RpcError

__all__ = [
    "CONNECT_RETRY_S",
    "Connection",
    "RpcClient",
    "RpcServer",
]

logger = logging.getLogger(__name__)

#: How long a client with ``timeout=None`` keeps retrying a busy server.
CONNECT_RETRY_S = 60.0

#: First and longest wait before retrying a failed ``accept()`` (e.g. out of file descriptors).
ACCEPT_BACKOFF_S = (0.05, 1.0)

#: How long :meth:`RpcServer.close` waits for its threads to end.
CLOSE_JOIN_S = 5.0


Handler = Callable[[str, Any, "Connection"], Any]


class Connection:
    """Server-side state of one authenticated client connection, handed to the handler."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int]):
        self.sock = sock
        self.peer = peer
        self.attrs: dict[str, Any] = {}


def _peer(peer: Any) -> str:
    try:
        return f"{peer[0]}:{peer[1]}"
    except (TypeError, IndexError):
        return str(peer)


class RpcServer:
    """A threaded TCP server that answers signed request frames with signed reply frames.

    ``handler(kind, data, conn)`` returns the reply data; an exception it raises is sent back to
    the caller as an ``("error", exc)`` reply. ``on_disconnect(conn)`` is called when an
    authenticated connection closes, for any reason. ``limits`` defaults to
    :meth:`RpcLimits.from_env`.
    """

    def __init__(
        self,
        secret: bytes,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        on_disconnect: Callable[[Connection], None] | None = None,
        limits: RpcLimits | None = None,
    ):
        if len(secret) < 16:
            raise ValueError("the RPC secret must be at least 16 bytes")
        self._secret = secret
        self._handler = handler
        self._on_disconnect = on_disconnect
        self.limits = limits if limits is not None else RpcLimits.from_env()
        self._unauthenticated = threading.BoundedSemaphore(self.limits.max_unauthenticated)
        self.refusals = RefusalLog("the driver service", self.limits.log_interval)
        #: Failed ``accept()`` calls by errno name (the server backs off and keeps serving).
        self.accept_errors: Counter[str] = Counter()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(256)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conn_threads: set[threading.Thread] = set()
        self._unauth_by_host: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="se-rpc-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        delay = 0.0
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # EMFILE/ENFILE (out of file descriptors), ENOBUFS/ENOMEM, ECONNABORTED: the
                # listening socket is fine and the connection waits in the backlog. Back off
                # and keep serving; one WARNING per episode, not one per try.
                delay = min(max(delay * 2, ACCEPT_BACKOFF_S[0]), ACCEPT_BACKOFF_S[1])
                self.accept_errors[errno.errorcode.get(exc.errno or 0, str(exc.errno))] += 1
                if delay == ACCEPT_BACKOFF_S[0]:
                    logger.warning(
                        "the driver service at %s:%d cannot accept connections (%s); retrying "
                        "every %gs at most. If this is 'Too many open files', raise the "
                        "driver's open-files limit (ulimit -n)",
                        *self.address, exc, ACCEPT_BACKOFF_S[1],
                    )  # fmt: skip
                self._closed.wait(delay)
                continue
            if self._closed.is_set():
                sock.close()
                return
            if delay:
                logger.warning(
                    "the driver service at %s:%d accepts connections again", *self.address
                )
                delay = 0.0
            if not self._unauthenticated.acquire(blocking=False):
                sock.close()
                self.refusals.note(
                    _peer(peer), "busy", f"{self.limits.max_unauthenticated} connections "
                    "were already authenticating"
                )  # fmt: skip
                continue
            host = str(peer[0])
            with self._lock:
                over = self._unauth_by_host[host] >= self.limits.max_unauthenticated_per_host
                if not over:
                    self._unauth_by_host[host] += 1
            if over:
                self._unauthenticated.release()
                sock.close()
                self.refusals.note(
                    _peer(peer), "per-address cap", f"{host} already had "
                    f"{self.limits.max_unauthenticated_per_host} connections authenticating"
                )  # fmt: skip
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(
                    target=self._serve, args=(sock, peer), name="se-rpc-conn", daemon=True
                )
                with self._lock:
                    if self._closed.is_set():  # close() ran meanwhile: it would miss this one
                        sock.close()
                        self._end_handshake(host)
                        return
                    self._conns.add(sock)
                    self._conn_threads.add(thread)
                thread.start()
            except BaseException:
                self._end_handshake(host)
                raise

    def _end_handshake(self, host: str) -> None:
        """Give back the handshake slots a connection from ``host`` held."""
        with self._lock:
            self._unauth_by_host[host] -= 1
            if self._unauth_by_host[host] <= 0:
                del self._unauth_by_host[host]
        self._unauthenticated.release()

    def _authenticate(self, sock: socket.socket) -> bytes:
        """Run the server side of the handshake; returns the session bytes."""
        deadline = time.monotonic() + self.limits.auth_timeout
        ns = os.urandom(NONCE_BYTES)
        sock.settimeout(self.limits.auth_timeout)
        sock.sendall(MAGIC + ns)
        magic = _recv_exact(sock, len(MAGIC), deadline)
        if magic != MAGIC:
            raise RpcError(f"handshake does not start with {MAGIC!r} (not our client or version)")
        rest = _recv_exact(sock, AUTH_BYTES - len(MAGIC), deadline)
        nc, mac = rest[:NONCE_BYTES], rest[NONCE_BYTES:]
        if not hmac.compare_digest(mac, handshake_mac(self._secret, b"se-client", ns, nc)):
            raise RpcError("handshake does not verify (wrong secret)")
        sock.sendall(handshake_mac(self._secret, b"se-server", ns, nc))
        return session_id(self._secret, ns, nc)

    def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        conn: Connection | None = None
        try:
            try:
                session = self._authenticate(sock)
            except DeadlineExceeded:
                self.refusals.note(_peer(peer), "handshake timed out")
                return
            except ConnectionClosed as exc:
                self.refusals.note(_peer(peer), "closed during handshake", f"{exc.got} bytes")
                return
            except (RpcError, OSError) as exc:
                self.refusals.note(_peer(peer), "failed authentication", str(exc))
                return
            finally:
                self._end_handshake(str(peer[0]))
            conn = Connection(sock, peer)
            self._serve_frames(conn, FrameCodec(self._secret, session, TO_CLIENT, TO_SERVER))
        except (OSError, EOFError, ValueError) as exc:
            logger.debug("connection from %s ended: %s", peer, exc)
        except Exception:  # a garbage payload that verified cannot happen; never kill the server
            logger.exception("unexpected error serving %s", peer)
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._conn_threads.discard(threading.current_thread())
            try:
                sock.close()
            except OSError:
                pass
            if conn is not None and self._on_disconnect is not None:
                self._on_disconnect(conn)

    def _serve_frames(self, conn: Connection, codec: FrameCodec) -> None:
        sock, frame_timeout = conn.sock, self.limits.frame_timeout
        while not self._closed.is_set():
            sock.settimeout(None)  # idle between frames is fine once authenticated
            try:
                kind, data = codec.read(sock, frame_timeout)
            except ConnectionClosed as exc:
                if exc.got or exc.wanted != _HEADER.size:
                    self.refusals.note(_peer(conn.peer), "truncated frame", str(exc))
                return
            except DeadlineExceeded as exc:
                self.refusals.note(_peer(conn.peer), "frame timed out", str(exc))
                return
            except RpcError as exc:
                self.refusals.note(_peer(conn.peer), "bad frame", str(exc))
                return
            try:
                reply: tuple[str, Any] = ("ok", self._handler(kind, data, conn))
            except Exception as exc:  # the handler's error goes back to the caller
                reply = ("error", exc)
            frame = codec.encode(*reply)
            sock.settimeout(frame_timeout + len(frame) / FRAME_MIN_RATE)
            sock.sendall(frame)

    def close(self, join_s: float = CLOSE_JOIN_S) -> None:
        """Stop accepting, close the listening socket and every connection, join the threads.

        Idempotent. The accept thread and the connection threads get ``join_s`` seconds in all
        to end (a handler still running past that keeps its thread, a daemon, until it returns;
        the job's abort wakes the long polls, so in practice they end at once). Closing alone
        did not stop a thread blocked in ``accept()``: it kept the socket, and the port,
        listening, and a driver leaked one thread per job.
        """
        self._closed.set()
        try:
            # Wakes a thread blocked in accept() (Linux: EINVAL); close() alone does not.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        deadline = time.monotonic() + join_s
        here = threading.current_thread()
        if self._thread is not here and self._thread.is_alive():
            self._thread.join(min(0.2, join_s))
            if self._thread.is_alive():
                _poke(self.address)  # where shutdown() does not wake accept(), a connection does
                self._thread.join(max(0.0, deadline - time.monotonic()))
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
            threads = list(self._conn_threads)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            if t is not here:
                t.join(max(0.0, deadline - time.monotonic()))
        self.refusals.flush()


def _poke(address: tuple[str, int]) -> None:
    """Connect to ``address`` and hang up at once (wakes an ``accept()``)."""
    try:
        socket.create_connection(address, timeout=0.5).close()
    except OSError:
        pass


def _open(
    address: tuple[str, int], timeout: float | None, connect_timeout: float | None = None
) -> tuple[socket.socket, bytes]:
    """Connect and read the server's hello; retry with backoff while the server is busy."""
    wait = timeout if timeout is not None else CONNECT_RETRY_S
    deadline = time.monotonic() + wait
    delay = 0.02
    while True:
        sock = socket.create_connection(address, timeout=connect_timeout or wait)
        try:
            sock.settimeout(wait)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, HELLO_BYTES)
        except (ConnectionClosed, ConnectionResetError) as exc:
            sock.close()  # closed before the hello: the server had too many handshakes going
            if time.monotonic() + delay >= deadline:
                raise RpcError(
                    f"the driver service at {address[0]}:{address[1]} kept closing new "
                    f"connections for {wait:g}s (too many unauthenticated connections, from all "
                    f"hosts or from this one; see {ev.RPC_MAX_UNAUTHENTICATED} and "
                    f"{ev.RPC_MAX_UNAUTHENTICATED_PER_HOST})"
                ) from exc
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)
            continue
        except BaseException:
            sock.close()
            raise
        if hello[: len(MAGIC)] != MAGIC:
            sock.close()
            raise RpcError(
                f"{address[0]}:{address[1]} is not a spark_estimators driver service of this "
                "version (bad greeting)"
            )
        sock.settimeout(timeout)
        return sock, hello[len(MAGIC) :]


class RpcClient:
    """A client connection to an :class:`RpcServer`; :meth:`call` is thread-safe."""

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        timeout: float | None = 30.0,
        connect_timeout: float | None = None,
    ):
        self.address = address
        self._secret = secret
        self._timeout = timeout
        # connect_timeout bounds the TCP connect alone (a host that drops the packets).
        self._sock, ns = _open(address, timeout, connect_timeout)
        nc = os.urandom(NONCE_BYTES)
        try:
            self._codec = FrameCodec(secret, session_id(secret, ns, nc), TO_SERVER, TO_CLIENT)
            self._sock.sendall(client_auth(secret, ns, nc))
        except BaseException:
            self._sock.close()
            raise
        self._server_proof: bytes | None = handshake_mac(secret, b"se-server", ns, nc)
        self._lock = threading.Lock()

    def another(self, timeout: float | None = 30.0) -> RpcClient:
        """A new, independent connection to the same server with the same secret."""
        return RpcClient(self.address, self._secret, timeout=timeout)

    def local_address(self) -> str:
        """The IP address this host uses to reach the driver (reachable by peers too)."""
        return str(self._sock.getsockname()[0])

    def _check_server(self) -> None:
        """Read and verify the server's handshake proof; before any request byte is sent."""
        assert self._server_proof is not None
        wait = self._timeout if self._timeout is not None else CONNECT_RETRY_S
        where = f"{self.address[0]}:{self.address[1]}"
        try:
            proof = _recv_exact(self._sock, MAC_BYTES, time.monotonic() + wait)
        except (ConnectionClosed, ConnectionResetError) as exc:
            raise RpcError(
                f"the driver service at {where} refused this connection's handshake (the secret "
                "is not this job's?)"
            ) from exc
        except DeadlineExceeded as exc:
            raise RpcError(
                f"{where} did not prove within {wait:g}s that it holds the job's secret; "
                "refusing to send it anything"
            ) from exc
        finally:
            self._sock.settimeout(self._timeout)
        if not hmac.compare_digest(proof, self._server_proof):
            raise RpcError(
                f"{where} did not prove that it holds the job's secret; refusing to talk to it"
            )
        self._server_proof = None

    def call(self, kind: str, data: Any = None, timeout: float | None = None) -> Any:
        """Send one request and wait for its reply; re-raise an error the handler raised.

        The first call of a connection first checks the server's proof of the secret (no byte
        of the request goes out before it verified).
        """
        with self._lock:
            if self._server_proof is not None:
                self._check_server()
            if timeout is not None:
                self._sock.settimeout(timeout)
            self._sock.sendall(self._codec.encode(kind, data))
            status, reply = self._codec.read(self._sock)
        if status == "error":
            raise reply
        return reply

    def close(self) -> None:
        """Close the connection."""
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
