"""A PMI-1 server, the process-manager half of MPICH's wire protocol.

It gives Spark-started ranks a real ``MPI_COMM_WORLD``. Under ``mpiexec`` the process manager
(hydra) tells each rank its rank and size and relays the address exchange of ``MPI_Init``
through PMI. Spark tasks are not started by ``mpiexec``, and independently started MPI
"singletons" cannot join each other on MPICH 5.0 (see ``docs/mpi.md``). So the driver plays
hydra's part: this server speaks the simple PMI-1 text protocol on a TCP port, and each rank
process starts with ``PMI_PORT=<host>:<port>`` and ``PMI_ID=<token>`` in its environment.
MPICH's client (``src/pmi/src/pmi_v1.c``) then connects, learns its rank and size, and exchanges
its business card through ``put`` / ``barrier_in`` / ``get``. After ``MPI_Init`` the data path
is MPI's own (shared memory, UCX, OFI); this server is idle until a rank finalises or
disconnects.

The protocol, one ``cmd=<name> key=value ...`` line per message, is in
:mod:`spark_estimators.driver.pmi_protocol`.

``PMI_ID`` is a random 31-bit token per rank rather than the rank itself, so a stranger on the
network cannot join the job by guessing small numbers; each token is accepted once. A connection
must identify itself with ``initack`` within ``auth_timeout`` seconds, at most
``max_unauthenticated`` connections may be waiting to do so (more are closed at once), and
refused connections are logged as one WARNING per ``log_interval`` (the driver service's
:class:`~spark_estimators.driver.limits.RpcLimits`, ``SPARK_ESTIMATORS_RPC_*``).

Failure detection: the PMI socket of a rank stays open until the process exits. A connection
that closes before ``finalize`` means the rank died or exited while possibly inside MPI, where
its peers would wait forever; the server reports it through ``on_failure`` within
milliseconds, and the launcher then stops the other ranks (MPI cannot interrupt them).
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spark_estimators.driver.limits import RefusalLog, RpcLimits
from spark_estimators.driver.pmi_protocol import (
    KEYLEN_MAX,
    KVSNAME_MAX,
    MAPPING_KEY,
    MAX_LINE,
    VALLEN_MAX,
    format_command,
    parse_command,
    process_mapping,
)

if TYPE_CHECKING:
    from spark_estimators.driver.service import DriverService

logger = logging.getLogger(__name__)

#: Environment variables of a rank process that point MPICH's PMI client at this server.
PMI_PORT = "PMI_PORT"
PMI_ID = "PMI_ID"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
#: Variables of another process manager that must not reach our ranks (PMI_FD wins over
#: PMI_PORT in MPICH's client, and would point at a descriptor that is not ours).
FOREIGN_PMI_VARS = ("PMI_FD", "PMI_SPAWNED", "PMI_TOTALVIEW")

#: ``on_failure(rank, message)``: a rank disconnected before finalize, or called MPI_Abort.
FailureSink = Callable[[int, str], None]


@dataclass(eq=False)  # identity: clients live in sets
class _Client:
    sock: socket.socket
    peer: str
    opened: float = 0.0  # monotonic time of accept
    inbox: bytearray = field(default_factory=bytearray)
    rank: int | None = None
    finalized: bool = False
    aborted: bool = False


# Commands a PMI-1 client may send that this server refuses, and the reply name MPICH expects.
_UNSUPPORTED = {
    "publish_name": "publish_result",
    "unpublish_name": "unpublish_result",
    "lookup_name": "lookup_result",
    "spawn": "spawn_result",
}


class PMIServer:
    """Serves PMI-1 to the ``size`` rank processes of one job, on a background thread.

    Parameters
    ----------
    size
        Number of ranks (``MPI_COMM_WORLD`` size).
    host
        Address to listen on, as the rank processes reach it (the Spark driver's host).
    mapping
        ``PMI_process_mapping`` (see :func:`process_mapping`), or a callable returning it when
        the first rank asks (rank placement is known only after Spark scheduled the tasks);
        None leaves the key unset, and MPICH then assumes one rank per node.
    on_failure
        Called from the server thread with ``(rank, message)`` when a rank disconnects before
        ``finalize`` or calls ``MPI_Abort``.
    limits
        ``auth_timeout``, ``max_unauthenticated`` and ``log_interval`` apply to connections that
        have not sent a valid ``initack`` yet; default :meth:`RpcLimits.from_env`.

    Examples
    --------
    >>> with PMIServer(2) as pmi:  # doctest: +SKIP
    ...     env0 = pmi.rank_env(0)  # {"PMI_PORT": "127.0.0.1:40123", "PMI_ID": "...", ...}
    """

    def __init__(
        self,
        size: int,
        host: str = "127.0.0.1",
        mapping: str | Callable[[], str | None] | None = None,
        on_failure: FailureSink | None = None,
        limits: RpcLimits | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.limits = limits if limits is not None else RpcLimits.from_env()
        self.refusals = RefusalLog("the PMI server", self.limits.log_interval, logger)
        self._pending: set[_Client] = set()  # connected, not identified yet
        self.kvsname = "se_kvs_" + secrets.token_hex(6)
        self._mapping = mapping
        self._on_failure = on_failure
        self._tokens: dict[int, int] = {}
        while len(self._tokens) < size:  # distinct, non-zero, fit MPICH's atoi()
            self._tokens.setdefault(secrets.randbelow(2**31 - 2) + 1, len(self._tokens))
        self._ids = {rank: token for token, rank in self._tokens.items()}
        self._kvs: dict[str, str] = {}
        self._barrier: list[_Client] = []
        self._lock = threading.Lock()
        self.finalized: set[int] = set()  # ranks that sent finalize
        self.connected: set[int] = set()  # ranks connected now
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="se-pmi-server", daemon=True)
        self._thread.start()

    # -- what the launcher uses --------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port``, the value of ``PMI_PORT``."""
        return f"{self.host}:{self.port}"

    def rank_env(self, rank: int) -> dict[str, str]:
        """Variables that make rank ``rank``'s ``MPI_Init`` join this job."""
        return {
            PMI_PORT: self.address,
            PMI_ID: str(self._ids[rank]),
            PMI_RANK: str(rank),
            PMI_SIZE: str(self.size),
        }

    def close(self) -> None:
        """Stop serving and close every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        self.refusals.flush()

    def __enter__(self) -> PMIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- server thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._next_deadline()):
                    if key.data == "wake":
                        break
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire_pending()
        except Exception:  # never let the server thread die silently
            logger.exception("PMI server failed")
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except BlockingIOError:
            return
        peer = f"{addr[0]}:{addr[1]}"
        if len(self._pending) >= self.limits.max_unauthenticated:
            sock.close()
            self.refusals.note(peer, "busy", f"{len(self._pending)} connections not identified")
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = _Client(sock, peer, opened=time.monotonic())
        self._pending.add(client)
        self._selector.register(sock, selectors.EVENT_READ, client)

    def _next_deadline(self) -> float | None:
        """Seconds until the oldest unidentified connection's time is up (None: no such one)."""
        if not self._pending:
            return None
        oldest = min(c.opened for c in self._pending)
        return max(0.0, oldest + self.limits.auth_timeout - time.monotonic())

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for client in [c for c in self._pending if now - c.opened >= self.limits.auth_timeout]:
            self._drop(client, "did not identify itself in time", refusal="initack timed out")

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(client, "closed its PMI connection")
            return
        client.inbox += data
        while b"\n" in client.inbox:
            line, _, rest = bytes(client.inbox).partition(b"\n")
            client.inbox = bytearray(rest)
            if not self._handle(client, line.decode("utf-8", "replace")):
                return
        if len(client.inbox) > MAX_LINE:
            self._drop(client, "sent an over-long PMI line", refusal="over-long line")

    def _send(self, client: _Client, payload: bytes) -> None:
        try:
            client.sock.sendall(payload)
        except OSError as exc:
            logger.debug("PMI send to %s failed: %s", client.peer, exc)

    def _drop(self, client: _Client, why: str, refusal: str | None = None) -> None:
        """Close ``client``; ``refusal`` (or any drop before ``initack``) counts as refused."""
        self._pending.discard(client)
        try:
            self._selector.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()
        if client in self._barrier:
            self._barrier.remove(client)
        rank = client.rank
        if rank is None:
            self.refusals.note(client.peer, refusal or "closed before initack", why)
            return
        with self._lock:
            self.connected.discard(rank)
        if client.finalized or client.aborted or self._closed:
            return
        message = (
            f"the rank process {why} before MPI_Finalize: it died or exited while its peers may "
            "be waiting for it inside MPI"
        )
        logger.debug("PMI: rank %d %s", rank, message)
        if self._on_failure is not None:
            self._on_failure(rank, message)

    def _handle(self, client: _Client, line: str) -> bool:
        """Answer one command; False when the connection was closed."""
        try:
            cmd, args = parse_command(line)
        except ValueError as exc:
            self._drop(client, f"sent a malformed PMI line ({exc})", refusal="malformed line")
            return False
        if client.rank is None and cmd != "initack":
            self._drop(client, f"sent {cmd!r} before initack", refusal="command before initack")
            return False
        if cmd == "abort":  # its message is sent unescaped: take the rest of the line
            args["message"] = line.partition(" message=")[2].rstrip("\n")
        handler = getattr(self, "_cmd_" + cmd, None)
        if handler is not None:
            return bool(handler(client, args))
        reply = _UNSUPPORTED.get(cmd)
        if reply is None:
            self._drop(client, f"sent the unsupported PMI command {cmd!r}")
            return False
        self._send(client, format_command(reply, rc=-1, msg=f"{cmd}_not_supported"))
        return True

    def _cmd_initack(self, client: _Client, args: dict[str, str]) -> bool:
        try:
            rank = self._tokens.get(int(args.get("pmiid", "")))
        except ValueError:
            rank = None
        with self._lock:
            fresh = rank is not None and rank not in self.connected and rank not in self.finalized
            if fresh:
                assert rank is not None
                self.connected.add(rank)
        if rank is None or not fresh:
            self._send(client, format_command("initack", rc=-1, msg="unknown_or_reused_pmiid"))
            self._drop(client, "was refused", refusal="unknown or reused PMI_ID")
            return False
        client.rank = rank
        self._pending.discard(client)
        self._send(
            client,
            format_command("initack", rc=0)
            + format_command("set", size=self.size)
            + format_command("set", rank=rank)
            + format_command("set", debug=0),
        )
        return True

    def _cmd_init(self, client: _Client, args: dict[str, str]) -> bool:
        if args.get("pmi_version") != "1":
            self._send(client, format_command("response_to_init", rc=-1, pmi_version=1,
                                              pmi_subversion=1))  # fmt: skip
            return True
        self._send(client, format_command("response_to_init", rc=0, pmi_version=1,
                                          pmi_subversion=1))  # fmt: skip
        return True

    def _cmd_get_maxes(self, client: _Client, args: dict[str, str]) -> bool:
        maxes = {"kvsname_max": KVSNAME_MAX, "keylen_max": KEYLEN_MAX, "vallen_max": VALLEN_MAX}
        self._send(client, format_command("maxes", rc=0, **maxes))
        return True

    def _cmd_get_appnum(self, client: _Client, args: dict[str, str]) -> bool:
        self._send(client, format_command("appnum", rc=0, appnum=0))
        return True

    def _cmd_get_universe_size(self, client: _Client, args: dict[str, str]) -> bool:
        self._send(client, format_command("universe_size", rc=0, size=self.size))
        return True

    def _cmd_get_my_kvsname(self, client: _Client, args: dict[str, str]) -> bool:
        self._send(client, format_command("my_kvsname", rc=0, kvsname=self.kvsname))
        return True

    def _cmd_put(self, client: _Client, args: dict[str, str]) -> bool:
        key, value = args.get("key", ""), args.get("value", "")
        if args.get("kvsname") != self.kvsname or not key:
            self._send(client, format_command("put_result", rc=-1, msg="bad_kvsname_or_key"))
        else:
            self._kvs[key] = value
            self._send(client, format_command("put_result", rc=0))
        return True

    def _cmd_get(self, client: _Client, args: dict[str, str]) -> bool:
        key = args.get("key", "")
        value = self._kvs.get(key)
        if value is None and key == MAPPING_KEY:
            try:
                mapping = self._mapping() if callable(self._mapping) else self._mapping
            except Exception:  # MPICH copes without a mapping; the job must not stall
                logger.exception("PMI: computing %s failed", MAPPING_KEY)
                mapping = None
            if mapping:
                value = self._kvs[key] = mapping
        if args.get("kvsname") != self.kvsname or value is None:
            self._send(client, format_command("get_result", rc=-1, msg="key_not_found"))
        else:
            self._send(client, format_command("get_result", rc=0, found="TRUE", value=value))
        return True

    def _cmd_barrier_in(self, client: _Client, args: dict[str, str]) -> bool:
        self._barrier.append(client)
        if len(self._barrier) == self.size:
            waiting, self._barrier = self._barrier, []
            for peer in waiting:
                self._send(peer, format_command("barrier_out", rc=0))
        return True

    def _cmd_finalize(self, client: _Client, args: dict[str, str]) -> bool:
        client.finalized = True
        with self._lock:
            if client.rank is not None:
                self.finalized.add(client.rank)
        self._send(client, format_command("finalize_ack", rc=0))
        return True

    def _cmd_abort(self, client: _Client, args: dict[str, str]) -> bool:
        client.aborted = True
        message = args.get("message", "")
        code = args.get("exitcode", "?")
        assert client.rank is not None
        if self._on_failure is not None:
            self._on_failure(client.rank, f"called MPI_Abort (exit code {code}): {message}")
        return True


def serve_mpi_job(svc: DriverService, host: str) -> PMIServer:
    """Start a PMI server for the job of ``svc`` (a :func:`spark_estimators.run` launch).

    Each rank's environment gets the server's variables (and loses a foreign ``PMI_FD``); the
    process mapping follows the ranks' host hashes, known once every task has registered; a
    rank that drops its PMI connection before finalising, or calls ``MPI_Abort``, fails the
    job at once (:meth:`DriverService.report_lost_rank`), so the launcher stops the others.
    """

    def mapping() -> str | None:
        by_rank = sorted(svc.state.settings.values(), key=lambda s: s.rank)
        return process_mapping([s.host_hash for s in by_rank]) if by_rank else None

    server = PMIServer(svc.state.num_proc, host, mapping=mapping, on_failure=svc.report_lost_rank)
    svc.set_rank_env(lambda settings: server.rank_env(settings.rank), unset=FOREIGN_PMI_VARS)
    return server


__all__ = [
    "FOREIGN_PMI_VARS",
    "PMIServer",
    "format_command",
    "parse_command",
    "process_mapping",
    "serve_mpi_job",
]
