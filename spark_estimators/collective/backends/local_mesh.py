"""Ranks on one host gather the engine's negotiation vectors over Unix sockets, not Gloo's TCP.

Every collective op starts with an allgather of a small int64 vector
(:mod:`spark_estimators.collective.runtime.engine`), and a small CPU allreduce travels inside it:
a training loop pays one such round per step. Through Gloo on the loopback that round took
0.3-0.6 ms on the 2-core machine, because each message passes through Gloo's I/O thread on both
sides. Between two processes of one host a Unix stream socket exchanges 50 KB in about 20 us
(bench/RESULTS.md, issue 26). So when every rank of the group runs on this host, the
torch.distributed backends connect the ranks pairwise through abstract Unix sockets at start and
gather the negotiation vectors there. The ops' own data (broadcasts, allgathers, allreduces too
large to go inline) still goes through the backend.

Setup, at ``init()``:

1. Each rank listens on a random abstract socket name and publishes the name and a random token
   in the job's rendezvous store. The store of ``run()`` and of the estimators lives in the
   driver service and opens only with the job's secret.
2. Each rank connects to every lower rank and sends its rank and that rank's token. A connect
   to a listening socket returns at once, before the peer accepts.
3. Each rank publishes whether all its connects worked, and reads every rank's answer.
4. If every rank connected, each accepts its higher ranks. It checks each peer's user
   (``SO_PEERCRED``) before it reads a byte, then the token; a peer that sends no hello within
   :data:`HELLO_TIMEOUT_S` is dropped and the rank accepts the next one.
5. Each rank publishes whether it accepted all its higher ranks, and reads every rank's answer.

If any rank could not connect or accept, every rank drops the mesh and the backend gathers as
before (a warning says why when it was not a plain "not reachable"). That happens, for example,
with ranks in different network namespaces that share a hostname, or when another local process
connects to a rank's socket (abstract names can be read in ``/proc/net/unix``) and stays silent:
the mesh is then given up within the start timeout, ``init()`` still succeeds. Each connecting
rank checks that the socket it reached belongs to its own user too. Set
``SPARK_ESTIMATORS_LOCAL_MESH=0`` to turn the mesh off. It needs Linux (abstract sockets).

Waiting: a rank whose peers' messages have not all come polls its sockets without sleeping for
up to :data:`SPIN_US` microseconds (:data:`~spark_estimators.envvars.MESH_SPIN_US`), then sleeps
in ``poll()``. Ranks of a training step meet every step, the first to finish its backward pass
waiting a fraction of a millisecond for the other; sleeping there cost ~0.1 ms a step on the
2-core machine (the wake-up, and the caches a sleeping core loses), more than the spin's own CPU
(bench/RESULTS.md, issue 45). It spins only when the host's ranks do not outnumber the cores this
process may use (its CPU affinity and its cgroup's CPU quota), so a spinning rank never takes
the core of a rank it waits for. A spin that runs out (a peer took longer) makes the next rounds
sleep at once, more of them for each such spin in a row, so ranks that wait long burn no core.

A message is a 24-byte header (the round number, a tag and the payload's bytes), then the
payload. Tag 0 marks the engine's negotiation vectors (:meth:`LocalMesh.allgather`); any other
tag a round of raw data that skips the negotiation (:meth:`LocalMesh.exchange`, the
``DistributedOptimizer``'s steady state, :mod:`spark_estimators.collective.torch.steady`). A round
in which the ranks' tags differ is *void* on every rank (each reads the others' whole messages,
so the streams stay in step): ``allgather`` runs it again, ``exchange`` returns False and its
caller falls back to a negotiated op. So a rank that negotiates (one that called ``join()``, or
whose next op is another one) never mistakes raw data for a vector, or the reverse. A peer that
closes its socket, sends another round, a message of another length under the same tag, or
stays silent for the collective timeout raises an error. The engine turns it into a
:class:`~spark_estimators.errors.CollectiveError` that breaks the group, as it does for any
backend failure.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators._base.owned import peer_uid, same_user_peer

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<QQQ")  # round, tag, payload bytes
_HELLO = struct.Struct("<Q16s")
_KEY = "spark_estimators/mesh/"
#: How long an accepted peer may take to send its hello (the ranks send it right after connect).
HELLO_TIMEOUT_S = 5.0
#: The tag of the engine's negotiation rounds (:meth:`LocalMesh.allgather`).
NEGOTIATION = 0
#: Bytes of the header in front of every message (what :meth:`LocalMesh.exchange` leaves free).
HEADER_BYTES = _HEADER.size
# A header announcing more than this is garbage, not a message to wait for.
_MOST_BYTES = 1 << 34
#: Mesh rounds a raw tag is not tried after a void round it was in (:meth:`LocalMesh.due`);
#: doubled for each void in a row, up to MOST_BACKOFF; back to this after a round it was taken.
BACKOFF = 64
MOST_BACKOFF = 4096
# Most tags whose back-off a mesh keeps (the oldest is forgotten first, the same on every rank).
_MOST_BACKED_OFF = 256
#: Default microseconds of polling without sleeping before a rank sleeps in a round (see above).
SPIN_US = 300
# Most rounds that sleep at once after spins that ran out in a row (LocalMesh._spun).
_MOST_NO_SPIN = 64


def usable_cores() -> float:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "<quota> <period>" or "max ..."
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota != "max" and float(period) > 0:
        cores = min(cores, float(quota) / float(period))
    return cores


def spin_seconds(ranks_here: int) -> float:
    """How long a waiting rank polls without sleeping (see the module doc), in seconds."""
    if os.environ.get(ev.MESH_SPIN_US, "").strip():
        return max(0.0, ev.env_float(ev.MESH_SPIN_US, SPIN_US)) * 1e-6
    return SPIN_US * 1e-6 if ranks_here <= usable_cores() else 0.0


def enabled(rank_count: int, ranks_here: int) -> bool:
    """True when all ``rank_count`` (> 1) ranks are on this host, on Linux, and it is not off."""
    if rank_count < 2 or ranks_here != rank_count or not sys.platform.startswith("linux"):
        return False
    return ev.env_on(ev.LOCAL_MESH)


class LocalMesh:
    """A connected socket to every other rank of the group; :meth:`allgather` gathers over them."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.spin = spin_seconds(size)  # every rank of the mesh is on this host
        # rounds left that sleep at once, and spins in a row that ran out: see _spun()
        self._no_spin_rounds = 0
        self._spin_misses = 0
        self._peers = peers
        self._by_fd = {sock.fileno(): (peer, sock) for peer, sock in peers.items()}
        for sock in peers.values():
            sock.setblocking(False)
        self._round = 0
        # raw tag -> (first mesh round it is tried again, its next back-off): see due()
        self._backoff: dict[int, tuple[int, int]] = {}

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, size: int, *, timeout: float, start_timeout: float
    ) -> LocalMesh | None:
        """Connect every pair of ranks (every rank calls this); None on all ranks if one failed."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"spark-estimators-mesh-{secrets.token_hex(16)}"
        token = secrets.token_bytes(16)
        peers: dict[int, socket.socket] = {}
        try:
            listener.bind("\0" + name)
            listener.listen(size)
            store.set(f"{_KEY}{rank}", f"{name}:{token.hex()}")
            connected = _connect_lower(store, rank, start_timeout, peers)
            store.set(f"{_KEY}ok/{rank}", "1" if connected else "0")
            answers = [store.get(f"{_KEY}ok/{r}") for r in range(size)]
            if any(a != b"1" for a in answers):
                failed = [r for r, a in enumerate(answers) if a != b"1"]
                logger.debug("local mesh off: rank(s) %s could not connect", failed)
                _close(peers)
                return None
            accepted = _accept_higher(listener, rank, size, token, start_timeout, peers)
            store.set(f"{_KEY}accepted/{rank}", "1" if accepted else "0")
            answers = [store.get(f"{_KEY}accepted/{r}") for r in range(size)]
            if any(a != b"1" for a in answers):
                failed = [r for r, a in enumerate(answers) if a != b"1"]
                logger.warning(
                    "local mesh off, collectives gather through the backend: rank(s) %s did not "
                    "get a hello from every local rank within the start timeout",
                    failed,
                )
                _close(peers)
                return None
        except BaseException:
            _close(peers)
            raise
        finally:
            listener.close()
        return cls(rank, size, peers, timeout)

    def allgather(self, vector: np.ndarray) -> np.ndarray:
        """Every rank's ``vector`` (int64, the same length on all ranks) as rows in rank order.

        A void round (a peer sent raw data of :meth:`exchange`) is run again.
        """
        mine = np.ascontiguousarray(vector, dtype=np.int64).reshape(-1)
        message = bytearray(_HEADER.size + mine.nbytes)
        message[_HEADER.size :] = mine.tobytes()
        out = np.empty((self.size, mine.size), dtype=np.int64)
        out[self.rank] = mine
        rows = out.view(np.uint8)
        into = {peer: memoryview(rows[peer]) for peer in self._peers}
        while not self._exchange_round(NEGOTIATION, memoryview(message), into):
            pass
        return out

    def exchange(self, tag: int, message: memoryview, into: dict[int, memoryview]) -> bool:
        """Send ``message[HEADER_BYTES:]`` to every peer; receive each peer's into ``into[peer]``.

        ``message`` leaves :data:`HEADER_BYTES` free in front (they are written here), ``tag``
        (> 0) names what the bytes are; every ``into[peer]`` has the payload's length. True when
        every rank sent ``tag``; False for a void round (some rank sent another tag: nothing of
        ``into`` is valid, and every rank of the group returns False or runs its round again).
        """
        if tag <= NEGOTIATION:
            raise ValueError(f"tag must be > {NEGOTIATION}, got {tag}")
        return self._exchange_round(tag, message, into)

    def due(self, tag: int) -> bool:
        """Whether a raw round of ``tag`` is worth trying now: none void in its back-off.

        A rank that does not send ``tag`` (it negotiates, called ``join()``, or reduces another
        bucket) makes that round void on every rank; trying every step would then cost a void
        round each. So after a void round, every raw tag in it waits :data:`BACKOFF` rounds,
        doubling for each void in a row, and a round taken with the tag resets it. Every rank
        reads every message of every round, so every rank knows the same tags of every void
        round and counts the same rounds: the answer is the same on every rank at the same
        round, whichever rank tried. (Counted per rank, e.g. in optimizer steps, the back-offs
        of ranks whose steps differ, after ``join()``, would never let their tries meet.)
        """
        entry = self._backoff.get(tag)
        return entry is None or self._round >= entry[0]

    def _settle(self, tag: int, void: bool, heads: dict[int, bytearray]) -> None:
        """Update the back-off of the raw tags of the round just ended (see :meth:`due`).

        ``heads``: every peer's header of the round (their tags).
        """
        backoff = self._backoff
        if not void:
            if tag != NEGOTIATION:
                backoff.pop(tag, None)
            return
        tags = {tag, *(_HEADER.unpack(head)[1] for head in heads.values())}
        tags.discard(NEGOTIATION)
        for raw in sorted(tags):
            _, wait = backoff.pop(raw, (0, BACKOFF))
            backoff[raw] = (self._round + 1 + wait, min(2 * wait, MOST_BACKOFF))
        while len(backoff) > _MOST_BACKED_OFF:
            del backoff[next(iter(backoff))]

    def _exchange_round(self, tag: int, message: memoryview, into: dict[int, memoryview]) -> bool:
        """One round: send ``message`` (header filled here), read every peer's whole message."""
        self._round += 1
        payload_bytes = len(message) - _HEADER.size
        _HEADER.pack_into(message, 0, self._round, tag, payload_bytes)
        expected = len(message)
        peers = self._peers
        sent = dict.fromkeys(peers, 0)
        heads = {peer: bytearray(_HEADER.size) for peer in peers}
        got = dict.fromkeys(peers, 0)
        ends = dict.fromkeys(peers, expected)  # header + the peer's payload, once its header came
        bodies: dict[int, memoryview] = {}
        void = False
        spin_until = 0.0
        spinning = self._spinning()
        for peer, sock in peers.items():  # most rounds fit the socket buffer: no poll
            sent[peer] = _send(sock, message, 0, peer)
        deadline = time.monotonic() + self.timeout
        pending = list(peers)
        events: list[tuple[int, int]] = [(peers[p].fileno(), select.POLLIN) for p in pending]
        while True:  # the first pass tries to read at once: the peers' data is often there
            for fd, event in events:
                peer, sock = self._by_fd[fd]
                if event & select.POLLOUT and sent[peer] < expected:
                    sent[peer] = _send(sock, message, sent[peer], peer)
                readable = event & (select.POLLIN | select.POLLHUP | select.POLLERR)
                if readable and got[peer] < ends[peer]:
                    n = got[peer]
                    if n < _HEADER.size:
                        n = got[peer] = _receive(sock, heads[peer], n, peer)
                        if n == _HEADER.size:
                            body, end = self._body(peer, heads[peer], tag, payload_bytes, into)
                            bodies[peer], ends[peer] = body, end
                            void |= end < 0
                            if end < 0:
                                ends[peer] = -end
                    if n >= _HEADER.size and n < ends[peer]:
                        got[peer] = _HEADER.size + _receive(
                            sock, bodies[peer], n - _HEADER.size, peer
                        )
                elif readable and sent[peer] < expected:
                    raise ConnectionError(f"rank {peer} closed its local mesh connection")
            pending = [p for p in pending if got[p] < ends[p] or sent[p] < expected]
            if not pending:
                self._settle(tag, void, heads)
                if spin_until:
                    self._spun(missed=time.perf_counter() >= spin_until)
                return not void
            masks = [
                (peers[peer].fileno(), (select.POLLIN if got[peer] < ends[peer] else 0)
                 | (select.POLLOUT if sent[peer] < expected else 0))
                for peer in pending
            ]  # fmt: skip
            if spinning:  # try again at once, without sleeping, up to self.spin seconds
                now = time.perf_counter()
                spin_until = spin_until or now + self.spin
                if now < spin_until:
                    events = masks
                    continue
            poll = select.poll()
            for fd, mask in masks:
                poll.register(fd, mask)
            left = deadline - time.monotonic()
            events = poll.poll(int(left * 1000) + 1) if left > 0 else []
            if not events and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank(s) {pending} did not exchange local mesh round {self._round} within "
                    f"the collective timeout ({self.timeout:g} s)"
                )

    def _spinning(self) -> bool:
        """Whether this round may spin before it sleeps (see :meth:`_spun`)."""
        if not self.spin:
            return False
        if self._no_spin_rounds:
            self._no_spin_rounds -= 1
            return False
        return True

    def _spun(self, missed: bool) -> None:
        """After a round that spun: ``missed``, the peers took longer than the spin.

        Spinning pays where the ranks meet within it (a training step's allreduce); where the
        waits are longer (a rank loading data, another job on the host) it only burns a core.
        So after a spin that ran out, the next rounds sleep at once: 2, 4, ... up to
        :data:`_MOST_NO_SPIN` rounds for spins that run out in a row, none after one that did not.
        """
        if not missed:
            self._spin_misses = 0
            return
        self._spin_misses = min(self._spin_misses + 1, _MOST_NO_SPIN.bit_length())
        self._no_spin_rounds = min(1 << self._spin_misses, _MOST_NO_SPIN)

    def _body(
        self, peer: int, head: bytearray, tag: int, payload_bytes: int, into: dict[int, memoryview]
    ) -> tuple[memoryview, int]:
        """Where ``peer``'s payload goes and where its message ends (negative: a void round)."""
        round_, their_tag, nbytes = _HEADER.unpack(head)
        if round_ != self._round or (their_tag == tag and nbytes != payload_bytes):
            raise ConnectionError(
                f"rank {peer} sent round {round_} with {nbytes} bytes where this rank is at "
                f"round {self._round} with {payload_bytes} bytes (local mesh out of step)"
            )
        if their_tag == tag:
            return into[peer], _HEADER.size + nbytes
        if nbytes > _MOST_BYTES:
            raise ConnectionError(f"rank {peer} announced {nbytes} bytes (local mesh out of step)")
        logger.debug("local mesh round %d void: rank %d sent tag %d", round_, peer, their_tag)
        return memoryview(bytearray(nbytes)), -(_HEADER.size + nbytes)

    def close(self) -> None:
        """Close every connection (the peers' next round fails at once)."""
        _close(self._peers)
        self._by_fd.clear()


def _connect_lower(
    store: dist.Store, rank: int, timeout: float, peers: dict[int, socket.socket]
) -> bool:
    """Connect to every lower rank; False (logged) when one cannot be reached from here."""
    for lower in range(rank):
        name, token_hex = store.get(f"{_KEY}{lower}").decode().rsplit(":", 1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + name)
            if not same_user_peer(sock):
                raise ConnectionRefusedError(f"the socket is held by user {peer_uid(sock)}")
            sock.sendall(_HELLO.pack(rank, bytes.fromhex(token_hex)))
        except OSError as exc:
            sock.close()
            logger.debug("local mesh: rank %d cannot reach rank %d: %s", rank, lower, exc)
            return False
        peers[lower] = sock
    return True


def _accept_higher(
    listener: socket.socket,
    rank: int,
    size: int,
    token: bytes,
    timeout: float,
    peers: dict[int, socket.socket],
) -> bool:
    """Accept every higher rank (queued already); False if they are not all there in time.

    A peer of another user is closed before a byte is read from it; one without the token, or
    silent for :data:`HELLO_TIMEOUT_S`, is closed and the next one accepted.
    """
    deadline = time.monotonic() + timeout
    wanted = size - 1 - rank
    accepted = 0
    while accepted < wanted:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return False
        if not same_user_peer(conn):
            logger.warning("local mesh: refused a connection of user %s", peer_uid(conn))
            conn.close()
            continue
        conn.settimeout(min(HELLO_TIMEOUT_S, max(left, 0.01)))
        try:
            hello = _recv_exact(conn, _HELLO.size)
        except OSError:
            hello = b""
        peer, their_token = _HELLO.unpack(hello) if hello else (-1, b"")
        if not secrets.compare_digest(their_token, token):
            conn.close()
            logger.warning("local mesh: refused a connection without the token")
            continue
        if not rank < peer < size or peer in peers:
            conn.close()
            raise ConnectionError(f"local mesh: rank {rank} got a second hello from rank {peer}")
        peers[peer] = conn
        accepted += 1
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return bytes(data)


def _send(sock: socket.socket, message: bytes | memoryview, offset: int, peer: int) -> int:
    try:
        return offset + sock.send(memoryview(message)[offset:])
    except BlockingIOError:
        return offset
    except OSError as exc:
        raise ConnectionError(f"rank {peer} closed its local mesh connection ({exc})") from exc


def _receive(sock: socket.socket, into: bytearray | memoryview, offset: int, peer: int) -> int:
    try:
        n = sock.recv_into(memoryview(into)[offset:])
    except BlockingIOError:
        return offset
    except OSError as exc:
        raise ConnectionError(f"rank {peer} closed its local mesh connection ({exc})") from exc
    if n == 0:
        raise ConnectionError(f"rank {peer} closed its local mesh connection (end of stream)")
    return offset + n


def _close(peers: dict[int, socket.socket]) -> None:
    for sock in peers.values():
        try:
            sock.close()
        except OSError:
            pass
    peers.clear()
