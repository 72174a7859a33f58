"""The driver service of one job: registration, rank assignment, rendezvous, results, failures.

Each Spark task registers (partition index, host, host hash, pid, GPUs, a port it holds). When
all ``num_proc`` tasks have registered, ranks are assigned so that the ranks of one host hash are
contiguous, and every task receives its settings. Rank 0's port is the rendezvous point
(``MASTER_PORT``): its task keeps holding it until rank 0's process has exited (see
:mod:`spark_estimators._base.ports`), so no other job can take it before rank 0's store binds.
The rank processes then fetch the function, stream output and events, and report a result or
a failure. The first failure sets the abort flag, which every task watches, so the whole job
stops within a second or two.

Naming the cause: when a rank dies, its peers' collectives fail at once (``CollectiveError``),
often before the dead rank's own task has reaped it and reported. Two things keep the error
pointing at the dead rank: a rank process's connection dropping before it reported anything is
recorded at once as that rank's (provisional) failure, and a ``CollectiveError`` report delays
the abort by up to :data:`CAUSE_GRACE_S`, so the dead rank's report can still arrive first.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar, Unpack

from spark_estimators._base.gpus import gpus_key, host_gpus
from spark_estimators.driver.kvstore import RendezvousKV, StoreRequest
from spark_estimators.driver.rpc import Connection, RpcServer
from spark_estimators.errors import RemoteError

StateT = TypeVar("StateT")

logger = logging.getLogger(__name__)

CAUSE_GRACE_S = 1.0


def is_consequence(message: str) -> bool:
    """True for a failure that only reports a peer's death (a collective that lost its peer)."""
    return message.startswith("CollectiveError")


OutputSink = Callable[[int, str, list[str]], None]
EventSink = Callable[[int, str, Any], None]
Handler = Callable[[Any, Connection], object]


class LogMessage(TypedDict):
    """A batch of a rank's output lines (``"log"``)."""

    rank: int
    stream: str
    lines: list[str]


class EventMessage(TypedDict):
    """An event sent by rank code with ``task.send_event`` (``"event"``)."""

    rank: int
    kind: str
    data: object


class ResultMessage(TypedDict):
    """A rank's pickled return value (``"result"``)."""

    rank: int
    value: bytes


class FailureMessage(TypedDict, total=False):
    """A rank's failure (``"failure"``): the fields of :class:`RemoteError`."""

    rank: int
    host: str
    message: str
    traceback: str
    exit_code: int | None


class RegisterReply(TypedDict):
    """The answer to a registration: the task's place in the job and its ranks' variables."""

    settings: RankSettings
    env: dict[str, str]
    unset: tuple[str, ...]


class WatchReply(TypedDict):
    """The answer to a task's watch: the job's abort reason, or None while it runs."""

    abort: str | None


class ServiceOptions(TypedDict, total=False):
    """The keyword arguments every driver service takes."""

    #: Extra environment variables of the rank processes.
    env: dict[str, str] | None
    #: Address to bind (the driver's address as executors see it); default 127.0.0.1.
    host: str
    #: ``output(rank, stream, lines)`` receives each rank's stdout/stderr lines.
    output: OutputSink | None
    #: ``events(rank, kind, data)`` receives events sent by rank code (metrics, progress).
    events: EventSink | None
    #: ``kind -> handler(data, conn)`` for requests the service has no method for.
    extra_handlers: Mapping[str, Handler] | None


@dataclass(frozen=True)
class Registration:
    """What a Spark task told the driver about itself."""

    index: int
    host: str
    host_hash: str
    pid: int
    address: str
    port: int
    gpus: tuple[str, ...] = ()
    attempt: int = 0


@dataclass(frozen=True)
class RankSettings:
    """What the driver tells a task: its place in the job and the rendezvous point."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    master_addr: str
    master_port: int
    host_hash: str
    #: The job's GPUs on this host in local-rank order: the rank's ``CUDA_VISIBLE_DEVICES``.
    host_gpus: tuple[str, ...] = ()


def assign_ranks(regs: list[Registration]) -> dict[int, RankSettings]:
    """Map task index -> settings; ranks of one host hash are contiguous.

    Hosts are ordered by their lowest task index. On a host, ranks follow the tasks' GPU
    addresses ("0" < "1" < "10"), then task index (the only order without GPUs), so that with
    one GPU per task ``local_rank`` numbers the host's GPUs in order and ``host_gpus`` (the
    ranks' ``CUDA_VISIBLE_DEVICES``) puts each rank's GPU at position ``local_rank``.
    ``cross_rank`` / ``cross_size`` follow Horovod: the rank among the processes that share a
    ``local_rank`` across hosts, and how many such processes there are.
    """
    by_host: dict[str, list[Registration]] = {}
    for reg in sorted(regs, key=lambda r: r.index):
        by_host.setdefault(reg.host_hash, []).append(reg)
    hosts = list(by_host)  # insertion order = lowest task index first
    for peers in by_host.values():
        peers.sort(key=lambda r: (gpus_key(r.gpus), r.index))
    visible = {h: host_gpus(r.gpus for r in by_host[h]) for h in hosts}
    ordered = [reg for h in hosts for reg in by_host[h]]
    master = ordered[0]
    out: dict[int, RankSettings] = {}
    for rank, reg in enumerate(ordered):
        peers = by_host[reg.host_hash]
        local_rank = peers.index(reg)
        same_slot = [h for h in hosts if len(by_host[h]) > local_rank]
        out[reg.index] = RankSettings(
            rank=rank,
            size=len(ordered),
            local_rank=local_rank,
            local_size=len(peers),
            cross_rank=same_slot.index(reg.host_hash),
            cross_size=len(same_slot),
            master_addr=master.address,
            master_port=master.port,
            host_hash=reg.host_hash,
            host_gpus=visible[reg.host_hash],
        )
    return out


@dataclass
class JobState:
    """What the driver knows of one ``run`` job: registrations, rank settings, results, failures."""

    num_proc: int
    registrations: dict[int, Registration] = field(default_factory=dict)
    settings: dict[int, RankSettings] = field(default_factory=dict)
    results: dict[int, bytes] = field(default_factory=dict)
    failures: dict[int, RemoteError] = field(default_factory=dict)
    finished_tasks: set[int] = field(default_factory=set)
    abort_reason: str | None = None


class JobServiceBase(ABC, Generic[StateT]):
    """What the driver services of a job share: the RPC server, state, condition, output sinks.

    Shared by :class:`DriverService` and the elastic driver service; subclasses set
    ``self.state`` before calling ``__init__``, change it only while holding ``_cond``, and
    answer request ``kind`` with a method ``_on_<kind>(data, conn)``.

    Parameters
    ----------
    secret
        Per-job HMAC key.
    payload
        cloudpickle of ``(fn, args, kwargs)``, handed to each rank process.
    **options
        :class:`ServiceOptions`: the ranks' extra environment, the address to bind, the sinks
        of the ranks' output and events, handlers of other requests.
    """

    state: StateT

    def __init__(self, secret: bytes, payload: bytes, **options: Unpack[ServiceOptions]) -> None:
        self.payload = payload
        self.env = dict(options.get("env") or {})
        self._cond = threading.Condition()
        self._output = options.get("output")
        self._events = options.get("events")
        self._extra = dict(options.get("extra_handlers") or {})
        self._rendezvous_kv = RendezvousKV()
        host = options.get("host", "127.0.0.1")
        self.server = RpcServer(secret, self._handle, host=host, on_disconnect=self._disconnected)

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the service listens on."""
        return self.server.address

    def _handle(self, kind: str, data: Any, conn: Connection) -> object:
        method = getattr(self, "_on_" + kind, None)
        if method is not None:
            return method(data, conn)
        if kind in self._extra:
            return self._extra[kind](data, conn)
        raise ValueError(f"unknown request {kind!r}")

    def _disconnected(self, conn: Connection) -> None:
        """A connection closed (a task or rank process may be gone)."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Abort the job with ``reason`` (the first reason wins) and wake every waiter."""

    def wait(self, predicate: Callable[[StateT], bool], timeout: float | None) -> bool:
        """Wait until ``predicate(state)`` holds; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.state), timeout=timeout)

    def notify(self) -> None:
        """Wake the waiters of :meth:`wait` to check their predicate again."""
        with self._cond:
            self._cond.notify_all()

    def _on_log(self, data: LogMessage, conn: Connection) -> None:
        if self._output is not None:
            self._output(int(data["rank"]), data["stream"], data["lines"])

    def _on_event(self, data: EventMessage, conn: Connection) -> None:
        if self._events is not None:
            self._events(int(data["rank"]), data["kind"], data["data"])

    def _on_store(self, data: StoreRequest, conn: Connection) -> object:
        """The ranks' collective rendezvous store (:mod:`spark_estimators.driver.kvstore`)."""
        return self._rendezvous_kv.handle(data)


class DriverService(JobServiceBase[JobState]):
    """Serves one ``run`` job over :class:`RpcServer`; the runner waits on it.

    Parameters
    ----------
    num_proc
        Number of tasks that must register.
    secret, payload, **options
        As for :class:`JobServiceBase`.
    """

    def __init__(
        self, num_proc: int, secret: bytes, payload: bytes, **options: Unpack[ServiceOptions]
    ) -> None:
        self.state = JobState(num_proc=num_proc)
        self._rank_env: Callable[[RankSettings], dict[str, str]] | None = None
        self._unset_env: tuple[str, ...] = ()
        self._provisional: set[int] = set()  # failures a rank's own later report may replace
        self._pending_abort: threading.Timer | None = None
        super().__init__(secret, payload, **options)

    def set_rank_env(
        self, rank_env: Callable[[RankSettings], dict[str, str]], unset: Sequence[str] = ()
    ) -> None:
        """Add per-rank variables to each rank's environment, and remove the ``unset`` ones.

        Used by the MPI launch (PMI variables); call before the tasks register.
        """
        self._rank_env = rank_env
        self._unset_env = tuple(unset)

    # -- handlers --------------------------------------------------------------------------------
    def _on_register(self, data: dict[str, Any], conn: Connection) -> RegisterReply:
        """A Spark task registers (the fields of :class:`Registration`); wait for all of them."""
        reg = Registration(**data)
        with self._cond:
            if reg.index in self.state.registrations and self.state.settings:
                raise RuntimeError(f"task {reg.index} registered twice")
            self.state.registrations[reg.index] = reg
            conn.attrs["task_index"] = reg.index
            if len(self.state.registrations) == self.state.num_proc:
                self.state.settings = assign_ranks(list(self.state.registrations.values()))
                self._cond.notify_all()
            while not self.state.settings and self.state.abort_reason is None:
                self._cond.wait()
            if self.state.abort_reason is not None:
                raise RuntimeError(f"job aborted before start: {self.state.abort_reason}")
            settings = self.state.settings[reg.index]
            conn.attrs["rank"] = settings.rank
        env = dict(self.env)
        if self._rank_env is not None:
            env.update(self._rank_env(settings))
        return {"settings": settings, "env": env, "unset": self._unset_env}

    def _on_fetch_fn(self, data: int, conn: Connection) -> bytes:
        conn.attrs["rank"] = int(data)
        conn.attrs["child"] = True
        return self.payload

    def _on_result(self, data: ResultMessage, conn: Connection) -> None:
        with self._cond:
            self.state.results[int(data["rank"])] = data["value"]
            self._cond.notify_all()

    def _on_failure(self, data: FailureMessage, conn: Connection) -> None:
        self.record_failure(RemoteError(**data))

    def _on_task_done(self, data: int, conn: Connection) -> None:
        with self._cond:
            self.state.finished_tasks.add(int(data))
            self._cond.notify_all()

    def _on_watch(self, data: float | None, conn: Connection) -> WatchReply:
        """Long poll: answer when the job is aborted or after ``data`` seconds."""
        timeout = float(data or 1.0)
        with self._cond:
            self._cond.wait_for(lambda: self.state.abort_reason is not None, timeout=timeout)
            return {"abort": self.state.abort_reason}

    def _on_all_reported(self, data: float | None, conn: Connection) -> bool:
        """Long poll: True once every rank has reported (or the job aborted), else after ``data`` s.

        A rank that has reported its result waits on this before its process exits: rank 0's
        process hosts the collective's rendezvous store, which the other ranks may still use
        (a late ``destroy_process_group``, a last store read) after rank 0 is done.
        """
        timeout = float(data or 1.0)

        def done() -> bool:
            state = self.state
            reported = len(state.results) + len(state.failures)
            return state.abort_reason is not None or reported >= state.num_proc

        with self._cond:
            return self._cond.wait_for(done, timeout=timeout)

    def _disconnected(self, conn: Connection) -> None:
        if conn.attrs.get("child"):
            # A rank process gone without a result or failure report: killed (a signal, the
            # out-of-memory killer) or exited hard. Its task's report replaces this one.
            self.report_lost_rank(
                int(conn.attrs["rank"]),
                "the rank process ended without reporting a result (killed by a signal?); "
                "its task's report follows",
            )
            return
        index = conn.attrs.get("task_index")
        if index is None:
            return
        with self._cond:
            if index in self.state.finished_tasks or self.state.abort_reason is not None:
                return
            settings = self.state.settings.get(index)
            if settings is None:
                # Lost before the rendezvous completed: Spark will report the task failure.
                return
            rank = settings.rank
            reg = self.state.registrations[index]
        if rank not in self.state.results:
            self.record_failure(
                RemoteError(
                    rank=rank,
                    host=reg.host,
                    message="the Spark task lost its connection to the driver "
                    "(its Python worker or executor died)",
                )
            )

    # -- used by the runner ----------------------------------------------------------------------
    def record_failure(self, failure: RemoteError, provisional: bool = False) -> None:
        """Record a rank's failure and abort the job.

        The first report of a rank is kept (it carries the traceback), unless it was
        ``provisional``: then the rank's own later report replaces it.
        """
        with self._cond:
            if failure.rank in self._provisional and not provisional:
                self._provisional.discard(failure.rank)
                self.state.failures[failure.rank] = failure
            elif failure.rank not in self.state.failures:
                self.state.failures[failure.rank] = failure
                if provisional:
                    self._provisional.add(failure.rank)
            if self.state.abort_reason is None:
                reason = f"rank {failure.rank} failed"
                if is_consequence(failure.message) and not provisional:
                    # A peer's death seen from a collective: give the dead rank's own report
                    # a moment to arrive before the tasks kill every rank process.
                    if self._pending_abort is None:
                        self._pending_abort = threading.Timer(
                            CAUSE_GRACE_S, self.abort, args=(reason,)
                        )
                        self._pending_abort.daemon = True
                        self._pending_abort.start()
                else:
                    self.state.abort_reason = reason
            self._cond.notify_all()

    def report_lost_rank(self, rank: int, message: str) -> None:
        """A rank process was seen dying from outside (e.g. its MPI connection dropped).

        Ignored once the job is aborting (the launcher kills ranks then) or when the rank has
        already reported; otherwise a provisional failure that aborts the job at once.
        """
        with self._cond:
            state = self.state
            if state.abort_reason is not None or rank in state.results or rank in state.failures:
                return
            hosts = [r.host for i, r in state.registrations.items()
                     if i in state.settings and state.settings[i].rank == rank]  # fmt: skip
        failure = RemoteError(rank=rank, host=hosts[0] if hosts else "?", message=message)
        self.record_failure(failure, provisional=True)

    def abort(self, reason: str) -> None:
        """Abort the job with ``reason`` (the first reason wins) and wake every waiter."""
        with self._cond:
            if self.state.abort_reason is None:
                self.state.abort_reason = reason
            self._cond.notify_all()

    def registered_summary(self) -> str:
        """The registered tasks, for error messages (``task 0 on host (pid …), …``)."""
        regs = sorted(self.state.registrations.values(), key=lambda r: r.index)
        if not regs:
            return "no task registered"
        return ", ".join(f"task {r.index} on {r.host} (pid {r.pid})" for r in regs)

    def close(self) -> None:
        """Abort the job if it is still running and stop the server."""
        if self._pending_abort is not None:
            self._pending_abort.cancel()
        self.abort("driver service closed")
        self.server.close()


def silent_ranks(state: JobState) -> str:
    """The ranks that sent neither a result nor a failure, by host ("" when every rank did).

    When every reported failure is only a peer's timeout (:func:`is_consequence`), these are the
    ranks the others were waiting for: a host cut off the network, or one that went down, sends
    nothing at all (``rank 4, 5 on host 'node3' (10.0.0.13)``).
    """
    by_host: dict[str, list[int]] = {}
    for index, settings in sorted(state.settings.items(), key=lambda item: item[1].rank):
        if settings.rank in state.results or settings.rank in state.failures:
            continue
        reg = state.registrations.get(index)
        where = f"{reg.host!r} ({reg.address})" if reg is not None else "an unknown host"
        by_host.setdefault(where, []).append(settings.rank)
    return "; ".join(
        f"rank {', '.join(map(str, ranks))} on host {where}" for where, ranks in by_host.items()
    )


def wait_until(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), never negative."""
    return max(0.0, deadline - time.monotonic())
