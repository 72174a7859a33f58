"""Process sets: collective ops on a subset of the ranks, as in Horovod.

A :class:`ProcessSet` names some ranks of the job. Once registered (``init(process_sets=[...])``
or :func:`add_process_set`, called identically and in the same order on every rank), its members
pass ``process_set=`` to any op; the op then runs among those ranks only, concurrently with ops
on other sets. Inside a set, :func:`~spark_estimators.collective.size`-like numbers are the set's
(``process_set.size()``, ``process_set.rank()``), while ``root_rank`` arguments stay *global*
ranks, as in Horovod.

How it works: each registered set gets its own backend over a subgroup of the job's
(``torch.distributed.new_group`` for gloo/nccl, ``MPI_Comm_create`` or the user's communicator
for mpi) and its own collective engine (thread, negotiation, mismatch detection), so an op on a
set never waits for ops on another. Registering and removing are collective over the global set
and are negotiated like any op: ranks that disagree on the set's ranks get a clear error.

Differences from Horovod: sets can always be added and removed after ``init()``
(``process_sets="dynamic"`` and ``HOROVOD_DYNAMIC_PROCESS_SETS`` are accepted and change
nothing). ``join()`` and the elastic API work on the global set only.

>>> import spark_estimators.collective.torch as hvd
>>> hvd.init()  # doctest: +SKIP
>>> even = hvd.add_process_set([0, 2])  # doctest: +SKIP
>>> if even.included():  # doctest: +SKIP
...     hvd.allreduce(torch.ones(3), process_set=even)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime.engine import Engine
from spark_estimators.collective.runtime.requests import Agreement, Kind, Request
from spark_estimators.errors import CollectiveError, ConfigurationError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mpi4py import MPI

    from spark_estimators.collective.backends.base import Backend

R = TypeVar("R")

_lock = threading.RLock()
_registry: dict[int, ProcessSet] = {}
_next_id = 1


class ProcessSet:
    """A subset of the job's ranks that collective ops can run on (``process_set=``).

    Parameters
    ----------
    ranks
        Global ranks of the members (any order, no duplicates), or an mpi4py communicator
        (MPI backend only; the members are the communicator's processes, which may differ from
        rank to rank, e.g. after ``COMM_WORLD.Split``).

    Notes
    -----
    A set is usable once registered; ``process_set_id`` is then its id (the global set is 0).
    """

    def __init__(self, ranks: Sequence[int] | MPI.Intracomm) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: MPI.Intracomm | None = None
        self._ranks: list[int] = []
        self._engine: Engine | None = None
        self._removed = False
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = cast("MPI.Intracomm", ranks)
            return
        try:
            members = [int(r) for r in cast("Sequence[int]", ranks)]
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"ProcessSet({ranks!r}) takes a list of ranks or an mpi4py communicator"
            ) from None
        if not members or len(set(members)) != len(members) or min(members) < 0:
            raise ConfigurationError(
                f"ProcessSet({ranks!r}): ranks must be a non-empty list of distinct ranks >= 0"
            )
        self._ranks = sorted(members)

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the members, sorted (empty for an unregistered communicator set)."""
        return list(self._ranks)

    def size(self) -> int | None:
        """Number of members; None before registration."""
        return None if self.process_set_id is None else len(self._ranks)

    def rank(self) -> int | None:
        """Rank of this process within the set, -1 if not a member; None before registration."""
        if self.process_set_id is None:
            return None
        me = _engine.require("ProcessSet.rank").backend.rank
        return self._ranks.index(me) if me in self._ranks else -1

    def included(self) -> bool | None:
        """Whether this process is a member; None before registration."""
        if self.process_set_id is None:
            return None
        return _engine.require("ProcessSet.included").backend.rank in self._ranks

    def _require_engine(self, op: str) -> Engine:
        if self.process_set_id is None:
            state = "was removed" if self._removed else "is not registered"
            raise CollectiveError(
                f"{op}() on {self!r}: the process set {state}; register it on every rank with "
                "hvd.add_process_set(...) or hvd.init(process_sets=[...]) first"
            )
        if self._engine is None:
            me = _engine.require(op).backend.rank
            raise CollectiveError(
                f"{op}() on {self!r} was called on rank {me}, which is not a member of the "
                f"process set; only ranks {self._ranks} may run ops on it"
            )
        return self._engine

    def __repr__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self._ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job (``hvd.global_process_set``, id 0)."""

    def __init__(self) -> None:
        super().__init__([0])
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        engine = _engine.current()
        return [] if engine is None else list(range(engine.backend.size))

    def size(self) -> int | None:
        return _engine.require("ProcessSet.size").backend.size

    def rank(self) -> int | None:
        return _engine.require("ProcessSet.rank").backend.rank

    def included(self) -> bool | None:
        return True

    def _require_engine(self, op: str) -> Engine:
        return _engine.require(op)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id=0, ranks={self.ranks}, mpi_comm=None)"


global_process_set: ProcessSet = _GlobalProcessSet()


def is_global(process_set: ProcessSet | None) -> bool:
    """True for None and the global set (ops take their fast, set-free path)."""
    return process_set is None or process_set is global_process_set


def global_root(process_set: ProcessSet | None, root_rank: int, what: str) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a rank within ``process_set``."""
    if process_set is None or is_global(process_set):
        return root_rank
    ranks = process_set.ranks
    if root_rank not in ranks:
        raise ConfigurationError(
            f"{what}: root_rank={root_rank!r} is not a member of {process_set!r}; root_rank is "
            "a global rank and must be one of the set's ranks"
        )
    return ranks.index(root_rank)


def _process_set_request(
    signature: tuple[object, ...], description: str, execute: Callable[[Agreement], R]
) -> R:
    engine = _engine.require(str(signature[0]) + "_process_set")
    request = Request(Kind.PROCESS_SET, description, signature, execute, description)
    return engine.submit(request, blocking=True).result()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call it identically and in the same order.

    Parameters
    ----------
    process_set
        A :class:`ProcessSet`, or the list of its global ranks.

    Returns
    -------
    ProcessSet
        The registered set (``process_set_id`` assigned).

    Raises
    ------
    ConfigurationError
        A rank out of range, a set with the same ranks already registered, or a set already
        registered.
    CollectiveError
        The ranks called it with different sets (every rank raises).
    """
    global _next_id
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    engine = _engine.require("add_process_set")
    backend = engine.backend
    if ps.process_set_id is not None:
        raise ConfigurationError(f"{ps!r} is already registered")
    if ps.mpi_comm is not None:
        ranks_of = getattr(backend, "ranks_of", None)
        if ranks_of is None:
            raise ConfigurationError(
                f"ProcessSet(comm) needs the mpi backend, but the backend is {backend.name!r}; "
                "pass a list of ranks instead"
            )
        ps._ranks = sorted(ranks_of(ps.mpi_comm))
    bad = [r for r in ps._ranks if r >= backend.size]
    if bad:
        raise ConfigurationError(
            f"add_process_set({ps._ranks}): rank(s) {bad} are not in the job (size {backend.size})"
        )
    with _lock:
        for other in _registry.values():
            if other._ranks == ps._ranks and other.mpi_comm is None and ps.mpi_comm is None:
                raise ConfigurationError(
                    f"a process set with ranks {ps._ranks} is already registered: {other!r}"
                )

    def execute(agreement: Agreement) -> Backend | None:
        if ps.mpi_comm is None:
            return backend.subgroup(ps._ranks)
        views = backend.allgather_object(ps._ranks)
        for r, view in enumerate(views):
            if r not in view or any(views[m] != view for m in view):
                raise CollectiveError(
                    f"ProcessSet(comm) registration: the communicators do not partition the "
                    f"ranks consistently (rank {r} sees members {view}); every member must "
                    "pass a communicator with the same members"
                )
        return backend.subgroup_from_comm(ps.mpi_comm)  # type: ignore[attr-defined]

    key = "comm" if ps.mpi_comm is not None else tuple(ps._ranks)
    sub = _process_set_request(("add", key), f"add_process_set({ps._ranks})", execute)
    with _lock:
        if sub is not None:
            ps._engine = Engine(sub)
            ps._engine.set_id = _next_id
            ps._engine.timeline = engine.timeline
            ps._engine.start()
        ps.process_set_id = _next_id
        ps._removed = False
        _registry[_next_id] = ps
        _next_id += 1
    logger.debug("registered %r", ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set (every rank calls it, in the same order); True if removed.

    Returns False for a set that is not registered. The global set cannot be removed.
    """
    if process_set is global_process_set:
        raise ConfigurationError("the global process set cannot be removed")
    set_id = process_set.process_set_id
    if set_id is None or _registry.get(set_id) is not process_set:
        return False
    sub_engine = process_set._engine

    def execute(agreement: Agreement) -> None:
        if sub_engine is not None:
            _stop(sub_engine)

    _process_set_request(("remove", set_id), f"remove_process_set({set_id})", execute)
    with _lock:
        _registry.pop(set_id, None)
        process_set._engine = None
        process_set.process_set_id = None
        process_set._removed = True
    return True


def _stop(engine: Engine) -> None:
    if engine.stop(timeout=engine.backend.timeout + 5.0):
        engine.backend.shutdown()
    else:
        logger.warning("a process set's engine was still busy; its group was left as is")


def registered() -> list[ProcessSet]:
    """The registered sets other than the global one, by id."""
    with _lock:
        return [_registry[k] for k in sorted(_registry)]


def shutdown_all() -> None:
    """Stop every set's engine and forget the sets (called by ``shutdown()``)."""
    global _next_id
    with _lock:
        sets = list(_registry.values())
        _registry.clear()
        _next_id = 1
    for ps in sets:
        if ps._engine is not None:
            _stop(ps._engine)
        ps._engine = None
        ps.process_set_id = None
        ps._removed = True


__all__ = [
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
]
