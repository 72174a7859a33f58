"""The driver service of an elastic job: workers, rendezvous rounds, results, resets.

A *worker* is one attempt of one Spark task (``"<partition>.<attempt>"``). It joins when
its task starts, and its rank process asks for a ``rendezvous`` before training and after every
reset. The service forms a *round* (ranks, size, rendezvous point) when every live worker is
waiting and there are at least ``min_num_proc`` of them; it waits a little longer
(``rejoin_wait``) for the replacement of a worker that just died, since Spark is retrying its
task, and never takes more than ``max_num_proc`` (extra workers wait for the next round).
Ranks that survive keep their order, so rank 0 of a new round always holds the committed state.

Rounds after the first are *resets*; more than ``reset_limit`` of them aborts the job. The job
is done when every rank of the current round reported a result.

A reset waits ``elastic_timeout`` for ``min_num_proc`` workers, but no less than the ranks'
collective timeout (+ 10 s) while live members of the last round have not come yet: when a host
is lost, survivors whose peers already left for the reset sit in a collective until it times out
(a ring allreduce waits on a live neighbour that itself waits on the dead host), then come.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import NotRequired, TypedDict, Unpack

from spark_estimators import envvars
from spark_estimators.driver.launch_job import positive_int, positive_seconds
from spark_estimators.driver.rpc import Connection
from spark_estimators.driver.service import (
    JobServiceBase,
    RankSettings,
    Registration,
    ServiceOptions,
    WatchReply,
    assign_ranks,
)
from spark_estimators.errors import ConfigurationError, RemoteError

logger = logging.getLogger(__name__)

JOINING, WAITING, RUNNING, FINISHED, DEAD = "joining", "waiting", "running", "finished", "dead"
POLL_S = 0.2
DEFAULT_ELASTIC_TIMEOUT = 600.0
DEFAULT_REJOIN_WAIT = 10.0
#: Beyond the collective timeout, how long a reset waits for the last round's live members.
STRAGGLER_GRACE_S = 10.0


class JoinMessage(TypedDict):
    """A Spark task attempt that joins the job (``"join"``)."""

    index: int
    attempt: int
    host: str
    host_hash: str
    address: str
    gpus: NotRequired[tuple[str, ...]]


class WorkerFailure(TypedDict):
    """A worker's rank process failed (``"failure"``).

    Sent first by the rank process itself (the exception and its traceback, no exit code), then
    by its Spark task once the process has exited (the exit code, the last stderr lines).
    """

    worker_id: str
    host: str
    message: str
    traceback: str
    exit_code: NotRequired[int | None]


class RendezvousMessage(TypedDict):
    """A rank process waits for the next round (``"rendezvous"``), offering its held port."""

    worker_id: str
    port: int


class RoundResult(TypedDict):
    """A rank's pickled return value in one round (``"result"``)."""

    worker_id: str
    round: int
    rank: int
    value: bytes


@dataclass
class Worker:
    """One attempt of one Spark task."""

    worker_id: str
    index: int
    attempt: int
    host: str
    host_hash: str
    address: str
    seq: int
    status: str = JOINING
    port: int = 0
    rank: int | None = None  # rank in the round it last took part in
    died_at: float | None = None
    gpus: tuple[str, ...] = ()  # the task's Spark GPU addresses (orders local ranks)


@dataclass(frozen=True)
class ElasticPolicy:
    """Sizes and timeouts of an elastic job, checked when built.

    ``min_num_proc <= num_proc <= max_num_proc``, positive timeouts, ``reset_limit`` None (no
    limit) or >= 0, ``rejoin_wait`` >= 0; :meth:`of` fills in the defaults of ``run_elastic``.
    """

    num_proc: int
    min_num_proc: int
    max_num_proc: int
    start_timeout: float
    elastic_timeout: float
    reset_limit: int | None
    rejoin_wait: float

    def __post_init__(self) -> None:
        num = positive_int("num_proc", self.num_proc)
        low = positive_int("min_num_proc", self.min_num_proc)
        high = positive_int("max_num_proc", self.max_num_proc)
        if not low <= num <= high:
            raise ConfigurationError(
                f"need min_num_proc <= num_proc <= max_num_proc, got {low} <= {num} <= {high}"
            )
        for name in ("start_timeout", "elastic_timeout"):
            object.__setattr__(self, name, positive_seconds(name, getattr(self, name)))
        limit = self.reset_limit
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ConfigurationError(f"reset_limit must be None or an int >= 0, got {limit!r}")
        if self.rejoin_wait < 0:
            raise ConfigurationError(f"rejoin_wait must be >= 0 seconds, got {self.rejoin_wait!r}")
        object.__setattr__(self, "rejoin_wait", float(self.rejoin_wait))

    @classmethod
    def of(
        cls,
        num_proc: int,
        min_num_proc: int | None,
        max_num_proc: int | None,
        start_timeout: float,
        elastic_timeout: float | None,
        reset_limit: int | None,
        rejoin_wait: float = DEFAULT_REJOIN_WAIT,
    ) -> ElasticPolicy:
        """The policy of ``run_elastic``'s arguments: min and max default to ``num_proc``."""
        return cls(
            num_proc,
            num_proc if min_num_proc is None else min_num_proc,
            num_proc if max_num_proc is None else max_num_proc,
            start_timeout,
            DEFAULT_ELASTIC_TIMEOUT if elastic_timeout is None else elastic_timeout,
            reset_limit,
            rejoin_wait,
        )


@dataclass
class ElasticState:
    """What the elastic driver knows: workers, the round and its members, results, resets."""

    workers: dict[str, Worker] = field(default_factory=dict)
    round: int = 0
    members: list[str] = field(default_factory=list)  # worker ids of the round, by rank
    settings: dict[str, RankSettings] = field(default_factory=dict)
    results: dict[int, bytes] = field(default_factory=dict)  # rank -> value, current round
    failures: list[RemoteError] = field(default_factory=list)
    #: worker id -> its entry in ``failures`` (a worker's first report is kept).
    failed_workers: dict[str, int] = field(default_factory=dict)
    resets: int = 0
    done: bool = False
    abort_reason: str | None = None
    abort_error: str = ""  # "reset_limit" | "min_num_proc" | "start_timeout"
    pending_since: float | None = None


class ElasticDriverService(JobServiceBase[ElasticState]):
    """Serves one elastic job over :class:`RpcServer`; see the module docstring."""

    def __init__(
        self,
        policy: ElasticPolicy,
        secret: bytes,
        payload: bytes,
        **options: Unpack[ServiceOptions],
    ) -> None:
        self.policy = policy
        self.state = ElasticState()
        self._seq = 0
        self._started = time.monotonic()
        self.straggler_grace = STRAGGLER_GRACE_S
        super().__init__(secret, payload, **options)
        self._collective_timeout = self._ranks_collective_timeout()

    def _ranks_collective_timeout(self) -> float:
        """The ranks' collective timeout: the job's ``env=``, else this process's environment."""
        for name in (envvars.COLLECTIVE_TIMEOUT, envvars.HOROVOD_GLOO_TIMEOUT_SECONDS):
            if name in self.env:
                try:
                    return float(self.env[name])
                except ValueError:
                    break  # the ranks refuse it with a clear error; use the default here
        return envvars.collective_timeout()

    # -- task side -------------------------------------------------------------------------------
    def _on_join(self, data: JoinMessage, conn: Connection) -> dict[str, object]:
        with self._cond:
            if self.state.done or self.state.abort_reason is not None:
                return {"status": "over"}
            self._seq += 1
            wid = f"{data['index']}.{data['attempt']}"
            self.state.workers[wid] = Worker(
                worker_id=wid,
                index=int(data["index"]),
                attempt=int(data["attempt"]),
                host=data["host"],
                host_hash=data["host_hash"],
                address=data["address"],
                seq=self._seq,
                gpus=tuple(data.get("gpus", ())),
            )
            conn.attrs["worker_id"] = wid
            self._cond.notify_all()
        return {"status": "ok", "worker_id": wid, "env": self.env}

    def _on_failure(self, data: WorkerFailure, conn: Connection) -> dict[str, bool]:
        """A rank process failed; the answer tells its task whether Spark should retry it.

        The rank process's own report (the user's exception and traceback) comes first and is
        kept; its task's report after the exit only adds the exit code ("exited ... without
        reporting a result" would hide the exception).
        """
        wid = data["worker_id"]
        with self._cond:
            worker = self.state.workers.get(wid)
            rank = worker.rank if worker is not None and worker.rank is not None else -1
            exit_code = data.get("exit_code")
            earlier = self.state.failed_workers.get(wid)
            if earlier is None:
                self.state.failed_workers[wid] = len(self.state.failures)
                self.state.failures.append(
                    RemoteError(
                        rank=rank,
                        host=data["host"],
                        message=data["message"],
                        traceback=data["traceback"],
                        exit_code=exit_code,
                    )
                )
            elif exit_code is not None and self.state.failures[earlier].exit_code is None:
                failures = self.state.failures
                failures[earlier] = replace(failures[earlier], exit_code=exit_code)
            self._mark_dead(wid)
            retry = not self.state.done and self.state.abort_reason is None
        return {"retry": retry}

    def _on_task_done(self, data: str, conn: Connection) -> None:
        with self._cond:
            conn.attrs["task_done"] = True
            self._cond.notify_all()

    def _on_watch(self, data: float | None, conn: Connection) -> WatchReply:
        with self._cond:
            self._cond.wait_for(lambda: self.state.abort_reason is not None, float(data or 1.0))
            return {"abort": self.state.abort_reason}

    # -- rank process side -----------------------------------------------------------------------
    def _on_fetch_fn(self, data: str, conn: Connection) -> bytes:
        return self.payload

    def _on_rendezvous(self, data: RendezvousMessage, conn: Connection) -> dict[str, object]:
        wid = data["worker_id"]
        conn.attrs["child_of"] = wid
        with self._cond:
            worker = self.state.workers[wid]
            if worker.status == DEAD:
                raise RuntimeError(f"worker {wid} was declared dead")
            worker.status, worker.port = WAITING, int(data["port"])
            if self.state.pending_since is None:
                self.state.pending_since = time.monotonic()
            self._cond.notify_all()
            while True:
                if self.state.abort_reason is not None:
                    raise RuntimeError(f"elastic job aborted: {self.state.abort_reason}")
                if self.state.done:
                    return {"done": True}
                if worker.status == RUNNING:
                    return {"round": self.state.round, "settings": self.state.settings[wid]}
                self._maybe_form_round()
                if worker.status != RUNNING:
                    self._cond.wait(POLL_S)

    def _on_host_updates(self, data: int, conn: Connection) -> bool:
        """True when a worker waits to join or a member of the round is gone."""
        with self._cond:
            members = set(self.state.members)
            for worker in self.state.workers.values():
                if worker.status == WAITING and worker.worker_id not in members:
                    return True
                if worker.status == DEAD and worker.worker_id in members:
                    return True
        return False

    def _on_result(self, data: RoundResult, conn: Connection) -> None:
        with self._cond:
            worker = self.state.workers[data["worker_id"]]
            if int(data["round"]) != self.state.round:
                return  # a straggler of an old round
            worker.status = FINISHED
            self.state.results[int(data["rank"])] = data["value"]
            if len(self.state.results) == len(self.state.members):
                self.state.done = True
            self._cond.notify_all()

    def _disconnected(self, conn: Connection) -> None:
        wid = conn.attrs.get("child_of") or conn.attrs.get("worker_id")
        if wid is None or conn.attrs.get("task_done"):
            return
        with self._cond:
            worker = self.state.workers.get(wid)
            if worker is not None and worker.status not in (FINISHED, DEAD):
                self._mark_dead(wid)

    # -- rounds ----------------------------------------------------------------------------------
    def _mark_dead(self, wid: str) -> None:
        worker = self.state.workers.get(wid)
        if worker is None or worker.status == DEAD:
            return
        was_member = wid in self.state.members
        worker.status, worker.died_at = DEAD, time.monotonic()
        if was_member and self.state.results and not self.state.done:
            # Some ranks already returned: the round cannot be formed again.
            self._abort(f"worker {wid} died after other ranks had finished", "finished")
        self._cond.notify_all()

    def _abort(self, reason: str, kind: str) -> None:
        if self.state.abort_reason is None:
            self.state.abort_reason, self.state.abort_error = reason, kind
        self._cond.notify_all()

    def _replacement_expected(self, now: float) -> bool:
        """A task died recently and Spark's retry of it has not joined yet."""
        live = {w.index for w in self.state.workers.values() if w.status != DEAD}
        for worker in self.state.workers.values():
            if (
                worker.status == DEAD
                and worker.index not in live
                and worker.died_at is not None
                and now - worker.died_at < self.policy.rejoin_wait
            ):
                return True
        return False

    def _maybe_form_round(self) -> None:
        policy, state, now = self.policy, self.state, time.monotonic()
        live = [w for w in state.workers.values() if w.status in (JOINING, WAITING, RUNNING)]
        waiting = [w for w in live if w.status == WAITING]
        if not waiting:
            return
        first = state.round == 0
        since = self._started if first else (state.pending_since or now)
        waited = now - since
        limit = policy.start_timeout if first else policy.elastic_timeout
        everyone = len(waiting) == len(live)
        enough = len(waiting) >= (policy.num_proc if first else policy.min_num_proc)
        full = len(waiting) >= policy.max_num_proc
        ready = enough and (full or (everyone and not self._replacement_expected(now)))
        if not ready and enough and waited >= limit:
            ready = True  # stragglers had their time: go on without them
        if not ready and not first and waited >= limit:
            # Live members of the last round still in a collective whose peers left: they come
            # once it times out, so wait for them that long before giving up on min_num_proc.
            members = set(state.members)
            stragglers = [w for w in live if w.status == RUNNING and w.worker_id in members]
            if len(waiting) + len(stragglers) >= policy.min_num_proc:
                limit = max(limit, self._collective_timeout + self.straggler_grace)
        if not ready:
            if waited >= limit:
                what = "start_timeout" if first else "elastic_timeout"
                if not first and limit > policy.elastic_timeout:
                    what = "the collective timeout + grace"  # waited for the stragglers
                self._abort(
                    f"only {len(waiting)} worker(s) at the rendezvous after {what}={limit:g}s "
                    f"(need {policy.num_proc if first else policy.min_num_proc})",
                    "start_timeout" if first else "min_num_proc",
                )
            return
        if not first:
            if policy.reset_limit is not None and state.resets + 1 > policy.reset_limit:
                self._abort(f"reset_limit={policy.reset_limit} reached", "reset_limit")
                return
            state.resets += 1
        self._form(waiting[: policy.max_num_proc])

    def _form(self, chosen: list[Worker]) -> None:
        state = self.state
        # Survivors first, in their old rank order (rank 0 holds the committed state).
        ordered = sorted(chosen, key=lambda w: (w.rank is None, w.rank or 0, w.index, w.seq))
        regs = [
            Registration(
                index=i,
                host=w.host,
                host_hash=w.host_hash,
                pid=0,
                address=w.address,
                port=w.port,
                gpus=w.gpus,
            )
            for i, w in enumerate(ordered)
        ]
        by_position = assign_ranks(regs)
        state.round += 1
        state.settings = {w.worker_id: by_position[i] for i, w in enumerate(ordered)}
        state.members = [
            w.worker_id for w in sorted(ordered, key=lambda w: state.settings[w.worker_id].rank)
        ]
        state.results = {}
        state.pending_since = None
        for w in ordered:
            w.status = RUNNING
            w.rank = state.settings[w.worker_id].rank
        logger.info(
            "elastic round %d: %d rank(s) %s (resets so far: %d)",
            state.round,
            len(ordered),
            state.members,
            state.resets,
        )
        self._cond.notify_all()

    # -- used by the launcher --------------------------------------------------------------------
    def tick(self) -> None:
        """Re-evaluate timeouts while no request arrives (called by the launcher's loop)."""
        with self._cond:
            if any(w.status == WAITING for w in self.state.workers.values()):
                self._maybe_form_round()
            elif (
                self.state.round == 0
                and not self.state.done
                and time.monotonic() - self._started > self.policy.start_timeout
            ):
                self._abort(
                    f"no worker reached the rendezvous within start_timeout="
                    f"{self.policy.start_timeout:g}s",
                    "start_timeout",
                )

    def abort(self, reason: str) -> None:
        """Abort the job with ``reason`` and wake every waiter."""
        with self._cond:
            self._abort(reason, "driver")

    def close(self) -> None:
        """Abort the job if it is still running and stop the server."""
        self.abort("driver service closed")
        self.server.close()
