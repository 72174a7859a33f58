"""The signed, length-prefixed frame protocol between the driver service and the ranks.

Wire format of one frame::

    magic  b"SEv1"            4 bytes
    length uint32 big-endian  4 bytes   (checked against the maximum before anything is read)
    body                      length bytes = direction(1) | session nonce(16) | seq(8) | payload
    mac    HMAC-SHA256        32 bytes over magic|length|body, keyed by the per-job secret

On connect the server sends a fresh random 16-byte session nonce. Every frame in both directions
carries that nonce and a sequence number that must grow by one, plus a direction byte, so a frame
replayed on the same connection, on another connection or reflected back is refused. The payload
is a cloudpickle of ``(kind, data)``, and is only unpickled after the MAC has been verified.

A connection that sends anything wrong is closed; the server keeps serving its other clients.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from spark_estimators.envvars import MAX_FRAME_BYTES, env_int
from spark_estimators.errors import RpcError

logger = logging.getLogger(__name__)

MAGIC = b"SEv1"
_HEADER = struct.Struct("!4sI")
_SEQ = struct.Struct("!Q")
NONCE_BYTES = 16
MAC_BYTES = 32
TO_SERVER = b"\x01"
TO_CLIENT = b"\x02"
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # 1 GiB: results (e.g. model weights) travel in frames.


def new_secret() -> bytes:
    """A fresh per-job random key."""
    return secrets.token_bytes(32)


def max_frame_bytes() -> int:
    return env_int(MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_BYTES)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise RpcError(f"connection closed after {got} of {n} bytes (truncated frame)")
        got += k
    return bytes(buf)


class FrameCodec:
    """Signs and verifies frames for one side of one connection."""

    def __init__(self, secret: bytes, session: bytes, send_dir: bytes, recv_dir: bytes):
        if len(secret) < 16:
            raise ValueError("the RPC secret must be at least 16 bytes")
        self._secret = secret
        self._session = session
        self._send_dir = send_dir
        self._recv_dir = recv_dir
        self._send_seq = 0
        self._recv_seq = 0
        self._max = max_frame_bytes()

    def encode(self, kind: str, data: Any) -> bytes:
        payload = cloudpickle.dumps((kind, data))
        body = self._send_dir + self._session + _SEQ.pack(self._send_seq) + payload
        if len(body) > self._max:
            raise RpcError(
                f"message {kind!r} is {len(body)} bytes, over the frame limit of {self._max}; "
                f"return less data from the function or raise {MAX_FRAME_BYTES}"
            )
        self._send_seq += 1
        header = _HEADER.pack(MAGIC, len(body))
        mac = hmac.new(self._secret, header + body, "sha256").digest()
        return header + body + mac

    def read(self, sock: socket.socket) -> tuple[str, Any]:
        header = _recv_exact(sock, _HEADER.size)
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise RpcError("bad frame magic")
        if length > self._max:
            raise RpcError(f"frame length {length} exceeds the limit of {self._max} bytes")
        if length < 1 + NONCE_BYTES + _SEQ.size:
            raise RpcError(f"frame length {length} is too short")
        body = _recv_exact(sock, length)
        mac = _recv_exact(sock, MAC_BYTES)
        want = hmac.new(self._secret, header + body, "sha256").digest()
        if not hmac.compare_digest(mac, want):
            raise RpcError("frame signature does not verify (wrong key or tampered frame)")
        direction = body[:1]
        session = body[1 : 1 + NONCE_BYTES]
        (seq,) = _SEQ.unpack(body[1 + NONCE_BYTES : 1 + NONCE_BYTES + _SEQ.size])
        if direction != self._recv_dir:
            raise RpcError("frame sent in the wrong direction (reflected frame)")
        if session != self._session:
            raise RpcError("frame belongs to another session (replayed frame)")
        if seq != self._recv_seq:
            raise RpcError(f"frame sequence {seq} where {self._recv_seq} was expected (replay)")
        self._recv_seq += 1
        kind, data = cloudpickle.loads(body[1 + NONCE_BYTES + _SEQ.size :])
        return kind, data


Handler = Callable[[str, Any, "Connection"], Any]


class Connection:
    """Server-side state of one client connection, handed to the handler."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int]):
        self.sock = sock
        self.peer = peer
        self.attrs: dict[str, Any] = {}


class RpcServer:
    """A threaded TCP server that answers signed request frames with signed reply frames.

    ``handler(kind, data, conn)`` returns the reply data; an exception it raises is sent back to
    the caller as an ``("error", exc)`` reply. ``on_disconnect(conn)`` is called when a connection
    closes, for any reason.
    """

    def __init__(
        self,
        secret: bytes,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        on_disconnect: Callable[[Connection], None] | None = None,
    ):
        self._secret = secret
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(256)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.rejected_frames = 0
        self._thread = threading.Thread(target=self._accept_loop, name="se-rpc-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(sock)
            threading.Thread(
                target=self._serve, args=(sock, peer), name="se-rpc-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        conn = Connection(sock, peer)
        session = os.urandom(NONCE_BYTES)
        codec = FrameCodec(self._secret, session, TO_CLIENT, TO_SERVER)
        try:
            sock.sendall(session)
            while not self._closed.is_set():
                try:
                    kind, data = codec.read(sock)
                except RpcError as exc:
                    if "closed after 0 of" not in str(exc):
                        self.rejected_frames += 1
                        logger.warning("refused a frame from %s: %s", peer, exc)
                    return
                try:
                    reply: tuple[str, Any] = ("ok", self._handler(kind, data, conn))
                except Exception as exc:  # the handler's error goes back to the caller
                    reply = ("error", exc)
                sock.sendall(codec.encode(*reply))
        except (OSError, EOFError, ValueError) as exc:
            logger.debug("connection from %s ended: %s", peer, exc)
        except Exception:  # a garbage payload that verified cannot happen; never kill the server
            logger.exception("unexpected error serving %s", peer)
        finally:
            with self._lock:
                self._conns.discard(sock)
            try:
                sock.close()
            except OSError:
                pass
            if self._on_disconnect is not None:
                self._on_disconnect(conn)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RpcClient:
    """A client connection to an :class:`RpcServer`; :meth:`call` is thread-safe."""

    def __init__(self, address: tuple[str, int], secret: bytes, timeout: float | None = 30.0):
        self.address = address
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = _recv_exact(self._sock, NONCE_BYTES)
        self._codec = FrameCodec(secret, session, TO_SERVER, TO_CLIENT)
        self._lock = threading.Lock()

    def local_address(self) -> str:
        """The IP address this host uses to reach the driver (reachable by peers too)."""
        return str(self._sock.getsockname()[0])

    def call(self, kind: str, data: Any = None, timeout: float | None = None) -> Any:
        """Send one request and wait for its reply; re-raise an error the handler raised."""
        with self._lock:
            if timeout is not None:
                self._sock.settimeout(timeout)
            self._sock.sendall(self._codec.encode(kind, data))
            status, reply = self._codec.read(self._sock)
        if status == "error":
            raise reply
        return reply

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
