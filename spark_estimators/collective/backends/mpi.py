"""Collective backend over MPI with mpi4py and numpy (no deep-learning framework needed).

Where the communicator comes from
---------------------------------
* ``init(comm=c)``: the given mpi4py intracommunicator (or a list of ``COMM_WORLD`` ranks, as in
  Horovod); rank, size, local and cross ranks are computed from it.
* Otherwise ``MPI.COMM_WORLD``. Under ``mpiexec`` the process manager formed it; inside
  :func:`spark_estimators.run` / ``python -m spark_estimators.launch --backend mpi`` the launcher
  serves MPICH's PMI-1 protocol (:mod:`spark_estimators.driver.pmi`) so that Spark-started
  processes form it too. With our launchers the topology (local/cross ranks) is the launcher's;
  under a foreign launcher it is derived from the communicator (shared-memory split).

Either way the backend works on its own duplicate (``Dup``) of that communicator, so user code
can call mpi4py on the original at the same time without its messages ever matching ours.

Threads
-------
The collective engine calls the backend from one thread at a time (its own or a caller's), so
``MPI_THREAD_SERIALIZED`` is enough; mpi4py asks for ``MPI_THREAD_MULTIPLE`` by default, which
is also what user code needs to call MPI while async ops run. :meth:`MPIBackend.
mpi_threads_supported` reports the level MPI really provided.

Buffers
-------
numpy arrays, or torch CPU tensors viewed as numpy (``bfloat16`` as ``uint16``: its
reductions run through an MPI user op that computes in float32). Moves (broadcast, allgather,
alltoall) send raw bytes; reductions use MPI's typed ops. ``bool`` reduces with logical or
(Sum, Max) and logical and (Min, Product).

Timeouts and failures
---------------------
An MPI call cannot be interrupted. A watchdog thread therefore aborts the job (``MPI_Abort``,
after writing which op hung and why to stderr) when an op runs past the collective timeout,
or when joining the group takes longer than the start timeout; the launcher or ``mpiexec``
then stops every rank. This is how NCCL's watchdog behaves too. In practice the launchers stop
the survivors of a failed rank long before that (see ``docs/mpi.md``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import Backend, Buffer, ReduceOp, Topology
from spark_estimators.collective.backends.mpi_buffers import (
    bf16_reduction,
    is_bf16,
    new_like,
    numpy_view,
)
from spark_estimators.errors import ConfigurationError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mpi4py import MPI

R = TypeVar("R")
T = TypeVar("T")

_WATCH_INTERVAL_S = 1.0


def _import_mpi() -> ModuleType:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigurationError(
            f"backend='mpi' needs mpi4py and an MPI library ({exc}); install them with "
            "pip install 'spark-estimators[mpi]' (mpi4py and the mpich wheel)"
        ) from exc
    return MPI


# -- topology --------------------------------------------------------------------------------
def topology_of(comm: MPI.Intracomm) -> Topology:
    """Horovod's rank numbers of this process in ``comm`` (hosts = shared-memory domains)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
    finally:
        local.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    try:
        cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    finally:
        cross.Free()
    return Topology(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=MPI.Get_processor_name(),
    )


def _engine_request() -> str:
    """The collective op the engine is running now, e.g. ``allreduce 'grad.w'`` (diagnostics).

    The backend only sees MPI calls (a hang usually shows as the negotiation's allgather); the
    engine's frame tells which op of the user's that call serves.
    """
    try:
        for top in sys._current_frames().values():
            frame: FrameType | None = top
            while frame is not None:
                request = frame.f_locals.get("request") if frame.f_code.co_name == "_run" else None
                if request is not None and hasattr(request, "kind") and hasattr(request, "name"):
                    return f"{request.kind.name.lower()} {request.name!r}"
                frame = frame.f_back
    except Exception:  # best effort only
        return ""
    return ""


class _Watchdog:
    """Aborts the job when one MPI call runs past its deadline (MPI calls cannot time out)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._deadline: float | None = None
        self._what = ""
        self._limit = 0.0
        self._setting = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="se-mpi-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, what: str, setting: str) -> None:
        self._what, self._limit, self._setting = what, seconds, setting
        self._deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        self._deadline = None

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(_WATCH_INTERVAL_S):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._abort()

    def _abort(self) -> None:
        op = _engine_request()
        what = self._what
        if op:
            what = op if op.startswith(what) else f"{what} (of {op})"
        sys.stderr.write(
            f"spark_estimators.collective (mpi): rank {self.rank}: {what} did not complete "
            f"within {self._limit:g} s ({self._setting}); a peer rank probably died or stopped "
            "calling collectives. An MPI call cannot be interrupted, so this rank aborts the "
            "job with MPI_Abort.\n"
        )
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        try:
            if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(1)
        finally:
            os._exit(1)


class MPIBackend(Backend):
    """Collectives over an MPI communicator (see the module docstring).

    Parameters
    ----------
    topology
        What the environment says (used with our launchers); replaced by the communicator's
        own numbers for ``comm=`` and foreign launchers.
    timeout, start_timeout
        See :class:`~spark_estimators.collective.backends.base.Backend`.
    comm
        An mpi4py intracommunicator or a list of ``COMM_WORLD`` ranks; None means
        ``COMM_WORLD``.
    """

    name: ClassVar[str] = "mpi"

    def __init__(
        self,
        topology: Topology,
        *,
        timeout: float,
        start_timeout: float,
        comm: MPI.Intracomm | Sequence[int] | None = None,
    ) -> None:
        super().__init__(topology, timeout=timeout, start_timeout=start_timeout)
        self._requested_comm = comm
        self.comm: Any = None  # the MPI.Intracomm, from start() to shutdown()
        self._ops: dict[ReduceOp, MPI.Op] = {}  # bfloat16 user ops, created on first use
        self._watchdog: _Watchdog | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise MPI (once per process) and check its rank and size against the launcher's."""
        watchdog = _Watchdog(self.topology.rank)
        watchdog.arm(self.start_timeout, "joining the MPI group (MPI_Init)", ev.START_TIMEOUT)
        try:
            mpi = _import_mpi()
            if mpi.Query_thread() < mpi.THREAD_SERIALIZED:
                raise ConfigurationError(
                    "backend='mpi' needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (its ops "
                    "run on a background thread), but MPI was initialised with thread level "
                    f"{mpi.Query_thread()}; do not lower mpi4py.rc.thread_level"
                )
            base = self._base_comm(mpi)
            if self._requested_comm is not None or ev.SE_SIZE not in os.environ:
                self.topology = topology_of(base)
            elif (base.Get_size(), base.Get_rank()) != (self.topology.size, self.topology.rank):
                raise ConfigurationError(
                    f"MPI_COMM_WORLD has rank {base.Get_rank()} of {base.Get_size()}, but the "
                    f"launcher started rank {self.topology.rank} of {self.topology.size}: the "
                    "process did not join the job's MPI group. Pass backend='mpi' to "
                    "spark_estimators.run / launch (which serve PMI to the ranks) instead of "
                    "only to init(), and do not import mpi4py before the rank starts"
                )
            watchdog.rank = self.topology.rank
            self.comm = base.Dup()
            self.comm.Set_name("spark_estimators")
            self.comm.Set_errhandler(mpi.ERRORS_RETURN)
        except BaseException:
            watchdog.stop()
            raise
        watchdog.disarm()
        self._watchdog = watchdog

    def _base_comm(self, mpi: ModuleType) -> MPI.Intracomm:
        comm = self._requested_comm
        if comm is None:
            return mpi.COMM_WORLD
        if isinstance(comm, mpi.Comm):
            if comm == mpi.COMM_NULL or not isinstance(comm, mpi.Intracomm):
                raise ConfigurationError(
                    f"init(comm={comm!r}) needs an mpi4py intracommunicator this process belongs "
                    "to (not COMM_NULL, not an intercommunicator)"
                )
            return comm
        try:
            ranks = [int(r) for r in comm]  # type: ignore[union-attr]  # else TypeError
        except TypeError:
            raise ConfigurationError(
                f"init(comm=...) takes an mpi4py communicator or a list of COMM_WORLD ranks, got "
                f"{type(comm).__name__}"
            ) from None
        world = mpi.COMM_WORLD
        if sorted(set(ranks)) != sorted(ranks) or not all(0 <= r < world.Get_size() for r in ranks):
            raise ConfigurationError(
                f"init(comm={ranks!r}): ranks must be distinct and in [0, {world.Get_size()})"
            )
        if world.Get_rank() not in ranks:
            raise ConfigurationError(
                f"init(comm={ranks!r}) was called on COMM_WORLD rank {world.Get_rank()}, which is "
                "not in the list; only the listed ranks may call it"
            )
        group = world.Get_group().Incl(ranks)
        try:
            return world.Create_group(group)
        finally:
            group.Free()

    # -- process sets ------------------------------------------------------------------------
    def subgroup(self, ranks: Sequence[int]) -> Backend | None:
        """A backend over a sub-communicator of ``ranks``; None on non-members."""
        mpi = _import_mpi()
        group = self.comm.Get_group().Incl([int(r) for r in ranks])
        try:
            # MPI_Comm_create is collective over the whole communicator: every rank calls it.
            comm = self._run("creating a process set", lambda: self.comm.Create(group))
        finally:
            group.Free()
        if comm == mpi.COMM_NULL:
            return None
        return self._sub_backend(comm)

    def subgroup_from_comm(self, comm: MPI.Intracomm) -> Backend:
        """A backend over a user's communicator (``hvd.ProcessSet(comm)``): a ``Dup`` of it."""
        mpi = _import_mpi()
        if not isinstance(comm, mpi.Intracomm) or comm == mpi.COMM_NULL:
            raise ConfigurationError(
                f"ProcessSet({comm!r}) needs an mpi4py intracommunicator this rank belongs to"
            )
        return self._sub_backend(self._run("creating a process set", comm.Dup))

    def ranks_of(self, comm: MPI.Intracomm) -> list[int]:
        """The ranks of this backend's communicator that form ``comm`` (in ``comm``'s order)."""
        mpi = _import_mpi()
        theirs = comm.Get_group()
        ours = self.comm.Get_group()
        try:
            translated = mpi.Group.Translate_ranks(theirs, list(range(comm.Get_size())), ours)
        finally:
            theirs.Free()
            ours.Free()
        if any(r == mpi.UNDEFINED for r in translated):
            raise ConfigurationError(
                "ProcessSet(comm): the communicator has processes outside this job's group"
            )
        return [int(r) for r in translated]

    def _sub_backend(self, comm: MPI.Intracomm) -> MPIBackend:
        mpi = _import_mpi()
        index, size = comm.Get_rank(), comm.Get_size()
        topo = Topology(rank=index, size=size, local_rank=index, local_size=size,
                        hostname=self.topology.hostname)  # fmt: skip
        sub = MPIBackend(topo, timeout=self.timeout, start_timeout=self.start_timeout)
        comm.Set_name("spark_estimators.process_set")
        comm.Set_errhandler(mpi.ERRORS_RETURN)
        sub.comm = comm
        sub._watchdog = _Watchdog(self.topology.rank)
        return sub

    def shutdown(self) -> None:
        """Free this backend's communicator (MPI itself stays initialised for the process)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for op in self._ops.values():
            try:
                op.Free()
            except Exception as exc:  # never fail a shutdown
                logger.debug("freeing an MPI op failed: %s", exc)
        self._ops.clear()
        if self.comm is not None:
            try:
                self.comm.Free()  # local in MPICH: safe on a broken group
            except Exception as exc:
                logger.debug("freeing the MPI communicator failed: %s", exc)
            self.comm = None

    def mpi_threads_supported(self) -> bool:
        """True when MPI was initialised with ``MPI_THREAD_MULTIPLE``."""
        mpi = _import_mpi()
        return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)

    # -- helpers -----------------------------------------------------------------------------
    def _run(self, what: str, call: Callable[[], R]) -> R:
        watchdog = self._watchdog
        if watchdog is None:
            return call()
        watchdog.arm(self.timeout, what, ev.COLLECTIVE_TIMEOUT)
        try:
            return call()
        finally:
            watchdog._deadline = None  # disarm(), inlined: this runs twice per op

    def _reduction(self, buf: Buffer, op: ReduceOp) -> tuple[np.ndarray | list[object], MPI.Op]:
        """The typed buffer specification and the MPI op for reducing ``buf``."""
        from mpi4py import MPI

        arr = numpy_view(buf)
        if is_bf16(buf):
            mpi_op = self._ops.get(op)
            if mpi_op is None:
                mpi_op = self._ops[op] = MPI.Op.Create(bf16_reduction(op), commute=True)
            return [arr, MPI.UINT16_T], mpi_op
        if arr.dtype == np.bool_:
            logical = MPI.LOR if op in (ReduceOp.SUM, ReduceOp.MAX) else MPI.LAND
            return [arr, MPI.C_BOOL], logical
        ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
               ReduceOp.PRODUCT: MPI.PROD}  # fmt: skip
        if op not in ops:
            raise ConfigurationError(f"backend='mpi' cannot reduce with op={op.name}")
        return arr, ops[op]  # mpi4py derives the MPI datatype from the array's format

    # -- data ops ----------------------------------------------------------------------------
    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """Reduce ``buf`` in place across the communicator (``MPI_Allreduce``)."""
        from mpi4py import MPI

        spec, mpi_op = self._reduction(buf, op)
        self._run("allreduce", lambda: self.comm.Allreduce(MPI.IN_PLACE, spec, mpi_op))

    def broadcast(self, buf: Buffer, root: int) -> None:
        """Overwrite ``buf`` with rank ``root``'s (``MPI_Bcast``)."""
        arr = numpy_view(buf)
        self._run("broadcast", lambda: self.comm.Bcast(arr, root=root))

    def barrier(self) -> None:
        """Block until every rank of the communicator arrives."""
        self._run("barrier", self.comm.Barrier)

    # Moves use the arrays' own MPI datatypes (mpi4py reads them from the buffer format; every
    # dtype _view returns has one), counted in elements.
    def allgather(self, buf: Buffer, first_dims: Sequence[int]) -> Buffer:
        """Concatenate every rank's ``buf`` on the first dimension (``MPI_Allgatherv``)."""
        src = numpy_view(buf)
        rest = src.shape[1:]
        out, recv = new_like(buf, (sum(first_dims), *rest))
        if first_dims.count(first_dims[0]) == len(first_dims):
            self._run("allgather", lambda: self.comm.Allgather(src, recv))
            return out
        row = math.prod(rest)
        counts = [d * row for d in first_dims]
        displs = list(itertools.accumulate(counts[:-1], initial=0))
        self._run("allgather", lambda: self.comm.Allgatherv(src, [recv, (counts, displs)]))
        return out

    def alltoall(self, buf: Buffer, send_rows: Sequence[int], recv_rows: Sequence[int]) -> Buffer:
        """Exchange row blocks with every rank (``MPI_Alltoallv``)."""
        src = numpy_view(buf)
        rest = src.shape[1:]
        out, recv = new_like(buf, (sum(recv_rows), *rest))
        row = math.prod(rest)
        scounts = [n * row for n in send_rows]
        rcounts = [n * row for n in recv_rows]
        sdispls = list(itertools.accumulate(scounts[:-1], initial=0))
        rdispls = list(itertools.accumulate(rcounts[:-1], initial=0))
        self._run(
            "alltoall",
            lambda: self.comm.Alltoallv([src, (scounts, sdispls)], [recv, (rcounts, rdispls)]),
        )
        return out

    def reducescatter(self, buf: Buffer, op: ReduceOp, rows: Sequence[int]) -> Buffer:
        """Reduce ``buf`` and return this rank's block of ``rows`` rows."""
        src = numpy_view(buf)
        rest = tuple(src.shape[1:])
        out, _ = new_like(buf, (rows[self.rank], *rest))
        per_row = math.prod(rest)
        counts = [n * per_row for n in rows]
        send, mpi_op = self._reduction(buf, op)
        recv, _ = self._reduction(out, op)
        self._run(
            "reducescatter",
            lambda: self.comm.Reduce_scatter(send, recv, recvcounts=counts, op=mpi_op),
        )
        return out

    # -- objects -----------------------------------------------------------------------------
    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's picklable ``obj``, in rank order."""
        return list(self._run("allgather_object", lambda: self.comm.allgather(obj)))

    def broadcast_object(self, obj: T, root: int) -> T:
        """Rank ``root``'s picklable ``obj`` on every rank."""
        return self._run("broadcast_object", lambda: self.comm.bcast(obj, root=root))

    # -- join support ------------------------------------------------------------------------
    def zeros(self, numel: int, dtype: str, device: str) -> Buffer:
        """A zero numpy buffer (the MPI backend is CPU-only)."""
        if device != "cpu":
            raise ConfigurationError(f"backend='mpi' has no device {device!r}; it is CPU-only")
        if dtype == "bfloat16":  # only torch has it; mirror the peers' bfloat16 reduction
            import torch

            return torch.zeros(numel, dtype=torch.bfloat16)
        return np.zeros(numel, dtype=np.dtype(dtype))


__all__ = ["MPIBackend", "topology_of"]
