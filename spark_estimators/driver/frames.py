"""The wire format of the driver protocol: handshake proofs, signed frames, exact reads.

:mod:`spark_estimators.driver.rpc` runs the server and the client on top of this; the handshake
is described there.

Wire format of one frame (after the handshake, both directions)::

    magic  b"SEv2"            4 bytes
    length uint32 big-endian  4 bytes   (checked against the maximum before anything is read)
    body                      length bytes = direction(1) | session(16) | seq(8) | payload
    mac    HMAC-SHA256        32 bytes over magic|length|body, keyed by the per-job secret

``session`` is derived from both nonces, so a frame replayed on another connection, or a whole
recorded conversation replayed to a client, is refused; ``seq`` must grow by one and the
direction byte must match, so a frame replayed on the same connection or reflected back is
refused. The payload is a cloudpickle of ``(kind, data)``, unpickled only after the MAC has
verified. Once a frame has started, it must complete within ``frame_timeout`` seconds plus one
second per MiB; between frames an authenticated connection may stay idle (the tasks hold theirs
open for the whole job, and long-polls keep a request open on the server).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time
from typing import Any

import cloudpickle

from spark_estimators.envvars import MAX_FRAME_BYTES, env_int
from spark_estimators.errors import RpcError

MAGIC = b"SEv2"
_HEADER = struct.Struct("!4sI")
_SEQ = struct.Struct("!Q")
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
AUTH_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
TO_SERVER = b"\x01"
TO_CLIENT = b"\x02"
_PREFIX = 1 + NONCE_BYTES + _SEQ.size
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # 1 GiB: results (e.g. model weights) travel in frames.
#: A started frame gets ``frame_timeout`` plus one second per this many bytes.
FRAME_MIN_RATE = 1 << 20


def new_secret() -> bytes:
    """A fresh per-job random key."""
    return secrets.token_bytes(32)


def max_frame_bytes() -> int:
    """The largest frame accepted: ``SPARK_ESTIMATORS_MAX_FRAME_BYTES``, else 1 GiB."""
    return env_int(MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_BYTES)


class ConnectionClosed(RpcError):
    """The peer closed the connection; ``got`` bytes of the expected ``wanted`` had arrived."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"connection closed after {got} of {wanted} bytes (truncated frame)")
        self.got, self.wanted = got, wanted

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.got, self.wanted))


class DeadlineExceeded(RpcError):
    """Bytes that had to arrive within a deadline did not."""


def _fill(sock: socket.socket, buf: bytearray, start: int, deadline: float | None) -> None:
    """Fill ``buf[start:]`` from ``sock``; by ``deadline`` (monotonic) when one is given.

    Without a deadline the socket's own timeout applies to each ``recv`` (and raises
    ``TimeoutError``); with one, the whole read must finish by then, however the bytes trickle.
    """
    view = memoryview(buf)
    got, n = start, len(buf)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"only {got} of {n} bytes arrived before the deadline")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if deadline is None:
                raise
            raise DeadlineExceeded(f"only {got} of {n} bytes arrived before the deadline") from None
        if k == 0:
            raise ConnectionClosed(got, n)
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    _fill(sock, buf, 0, deadline)
    return bytes(buf)


def handshake_mac(secret: bytes, label: bytes, ns: bytes, nc: bytes) -> bytes:
    """HMAC-SHA256 of ``label | ns | nc`` under the job's secret (the handshake's proofs)."""
    return hmac.new(secret, label + ns + nc, "sha256").digest()


def session_id(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    """The session bytes every frame of the connection with nonces ``ns``/``nc`` carries."""
    return handshake_mac(secret, b"se-session", ns, nc)[:NONCE_BYTES]


def client_auth(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    """The client's handshake answer (:data:`AUTH_BYTES` long) to the server nonce ``ns``."""
    return MAGIC + nc + handshake_mac(secret, b"se-client", ns, nc)


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
        """One signed frame of the message ``(kind, data)``; raise over the frame limit."""
        payload = cloudpickle.dumps((kind, data))
        prefix = self._send_dir + self._session + _SEQ.pack(self._send_seq)
        length = len(prefix) + len(payload)
        if length > self._max:
            raise RpcError(
                f"message {kind!r} is {length} bytes, over the frame limit of {self._max}; "
                f"return less data from the function or raise {MAX_FRAME_BYTES}"
            )
        self._send_seq += 1
        header = _HEADER.pack(MAGIC, length)
        mac = hmac.new(self._secret, header, "sha256")
        mac.update(prefix)
        mac.update(payload)
        return b"".join((header, prefix, payload, mac.digest()))

    def read(self, sock: socket.socket, frame_timeout: float | None = None) -> tuple[str, Any]:
        """Read and verify one frame.

        The wait for its first bytes follows the socket's timeout; with ``frame_timeout``, the
        rest must arrive within ``frame_timeout`` seconds plus one second per MiB of its length.
        """
        header = bytearray(_HEADER.size)
        view = memoryview(header)
        first = sock.recv_into(view, len(header))
        if first == 0:
            raise ConnectionClosed(0, len(header))
        deadline = None if frame_timeout is None else time.monotonic() + frame_timeout
        _fill(sock, header, first, deadline)
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise RpcError("bad frame magic")
        if length > self._max:
            raise RpcError(f"frame length {length} exceeds the limit of {self._max} bytes")
        if length < _PREFIX:
            raise RpcError(f"frame length {length} is too short")
        if deadline is not None:
            deadline += length / FRAME_MIN_RATE
        rest = bytearray(length + MAC_BYTES)
        _fill(sock, rest, 0, deadline)
        body = memoryview(rest)[:length]
        want = hmac.new(self._secret, header, "sha256")
        want.update(body)
        if not hmac.compare_digest(memoryview(rest)[length:], want.digest()):
            raise RpcError("frame signature does not verify (wrong key or tampered frame)")
        direction = bytes(body[:1])
        session = bytes(body[1 : 1 + NONCE_BYTES])
        (seq,) = _SEQ.unpack(body[1 + NONCE_BYTES : _PREFIX])
        if direction != self._recv_dir:
            raise RpcError("frame sent in the wrong direction (reflected frame)")
        if session != self._session:
            raise RpcError("frame belongs to another session (replayed frame)")
        if seq != self._recv_seq:
            raise RpcError(f"frame sequence {seq} where {self._recv_seq} was expected (replay)")
        self._recv_seq += 1
        kind, data = cloudpickle.loads(body[_PREFIX:])
        return kind, data
