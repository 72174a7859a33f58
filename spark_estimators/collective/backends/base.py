"""The backend interface of the collective layer, the reduction ops, and the backend registry.

A *backend* moves bytes between the ranks of one job. The core (:mod:`spark_estimators.collective`)
and the framework adapters (:mod:`spark_estimators.collective.torch`, ``collective.keras``) never
talk to ``torch.distributed`` or ``mpi4py`` directly: every operation goes through the collective
engine (one background thread per process that negotiates each operation across ranks, see
:mod:`spark_estimators.collective.runtime.engine`), and the engine calls the active
backend's methods.

Writing a backend
-----------------
Subclass :class:`Backend`, implement the abstract methods and register the class under a name
with :func:`register_backend` (or add a lazy ``"module:Class"`` entry to ``_REGISTRY`` so the
module is imported only when chosen). The contract:

* **Buffers** are contiguous numpy arrays or torch tensors (CPU, or CUDA for device backends).
  For a CPU buffer of either kind ``numpy.asarray(buf)`` is a view sharing its memory, so a
  numpy-only backend (MPI) handles torch CPU tensors without importing torch. New buffers a
  backend returns (allgather, alltoall, reducescatter) may be numpy arrays whatever the input;
  the framework adapter converts them (the torch backends return tensors for tensors).
* Methods are called **only from the engine thread**, one at a time, in the same order on every
  rank: the engine has already checked that all ranks agree on the operation, the dtype and the
  shapes, so a backend needs no validation of its own.
* Ops **block** until done and raise an exception (any type; the engine wraps it into
  :class:`~spark_estimators.errors.CollectiveError`) when a peer dies or ``timeout`` seconds pass.
  After an error the engine marks the group broken and calls no further op except ``shutdown``.
* Reductions receive :class:`ReduceOp` ``SUM``, ``MIN``, ``MAX`` or ``PRODUCT``; ``AVERAGE`` only
  when :attr:`Backend.native_average` is true (the engine otherwise sums and scales).

The methods, in short::

    start()                                  rendezvous; called once by init()
    shutdown()                               release the group (must not hang on a broken group)
    allreduce(buf, op)                       in place
    allgather(buf, first_dims) -> buf        concatenation on dim 0; first_dims[r] = rows of rank r
    broadcast(buf, root)                     in place
    alltoall(buf, send_rows, recv_rows) -> buf
    reducescatter(buf, op, rows) -> buf      default: allreduce a copy, keep this rank's rows
    barrier()
    allgather_object(obj) -> list            default: pickle + allgather of bytes
    gather_vectors(vector) -> rows           the engine's negotiation round; default allgather
    local_mesh() -> LocalMesh | None         Unix sockets to every rank when all share the host
    broadcast_object(obj, root) -> obj       default: pickle + broadcast of bytes
    zeros(numel, dtype, device) -> buf       what a joined rank contributes (default: numpy)
    mpi_threads_supported() -> bool          default False
    subgroup(ranks) -> Backend | None        a backend over a subset of the ranks (process sets);
                                             called by every rank, None on non-members
"""

from __future__ import annotations

import abc
import enum
import importlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    from spark_estimators.collective.backends.local_mesh import LocalMesh

Buffer = Any  # a contiguous numpy.ndarray or torch.Tensor
#: An object sent to every rank and received as the same kind of object.
T = TypeVar("T")

# Every dtype the negotiation can name; the index is the wire code.
DTYPES: tuple[str, ...] = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
)
FLOATING_DTYPES = frozenset(
    {"float32", "float64", "float16", "bfloat16", "complex64", "complex128"}
)


def dtype_code(name: str) -> int:
    """Wire code of a dtype name (``"float32"`` -> 0)."""
    try:
        return DTYPES.index(name)
    except ValueError:
        raise ConfigurationError(
            f"dtype {name!r} is not supported by collective ops; supported: {', '.join(DTYPES)}"
        ) from None


class ReduceOp(enum.IntEnum):
    """Reduction operations, with Horovod's names and values (``hvd.Average`` ...)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


def resolve_op(
    op: ReduceOp | int | None, average: bool | None = None, *, adasum: bool = False
) -> ReduceOp:
    """Horovod's rule: ``op`` wins; the deprecated ``average`` flag maps to Average/Sum.

    ``adasum=True`` (allreduce) accepts ``Adasum``; other callers refuse it with a clear error.
    """
    if op is not None and average is not None:
        raise ConfigurationError("pass op= or the deprecated average=, not both")
    if op is None:
        op = ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    try:
        resolved = ReduceOp(int(op))
    except ValueError:
        raise ConfigurationError(
            f"op={op!r} is not a reduction op; use Average, Sum, Min, Max or Product"
        ) from None
    if resolved is ReduceOp.ADASUM and not adasum:
        raise ConfigurationError(
            "op=Adasum is not supported here (only allreduce, grouped_allreduce and the torch "
            "DistributedOptimizer take it); use Average (the default)"
        )
    return resolved


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job (Horovod's rank/size/local/cross numbers)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    hostname: str = ""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigurationError(f"rank={self.rank} must be in [0, size={self.size})")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ConfigurationError(
                f"local_rank={self.local_rank} must be in [0, local_size={self.local_size})"
            )
        if self.cross_size < 1 or not 0 <= self.cross_rank < self.cross_size:
            raise ConfigurationError(
                f"cross_rank={self.cross_rank} must be in [0, cross_size={self.cross_size})"
            )


class Backend(abc.ABC):
    """A collective backend: see the module docstring for the contract.

    Parameters
    ----------
    topology
        This process's place in the job.
    timeout
        Seconds after which a collective op gives up (a peer that died or never arrives).
    start_timeout
        Seconds to wait for every rank to reach the rendezvous in :meth:`start`.
    """

    name: ClassVar[str] = ""

    def __init__(self, topology: Topology, *, timeout: float, start_timeout: float) -> None:
        #: True when :meth:`allreduce` accepts ``ReduceOp.AVERAGE`` for floating buffers
        #: (decided in :meth:`start`; the same on every rank of a job).
        self.native_average = False
        self.topology = topology
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)

    @property
    def rank(self) -> int:
        """Rank of this process in the group (``topology.rank``)."""
        return self.topology.rank

    @property
    def size(self) -> int:
        """Number of ranks in the group (``topology.size``)."""
        return self.topology.size

    # -- lifecycle ---------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Rendezvous with the other ranks; raise on ``start_timeout``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the group; must return promptly even after a failed op."""

    def mpi_threads_supported(self) -> bool:
        """True only for an MPI backend initialised with ``MPI_THREAD_MULTIPLE``."""
        return False

    def subgroup(self, ranks: Sequence[int]) -> Backend | None:
        """A backend over ``ranks`` (sorted ranks of this group), for a process set.

        Every rank of this group calls it with the same ``ranks``, in the same order as its other
        ops; members get a started backend whose rank and size are those within the set,
        non-members None. The returned backend's :meth:`shutdown` releases the subgroup.
        """
        raise ConfigurationError(
            f"collective backend {self.name!r} does not support process sets; use gloo, nccl or mpi"
        )

    # -- data ops ----------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """Reduce ``buf`` across ranks, in place."""

    @abc.abstractmethod
    def allgather(self, buf: Buffer, first_dims: Sequence[int]) -> Buffer:
        """Concatenate every rank's ``buf`` on dim 0; ``first_dims[r]`` is rank r's dim 0."""

    @abc.abstractmethod
    def broadcast(self, buf: Buffer, root: int) -> None:
        """Overwrite ``buf`` with ``root``'s, in place."""

    @abc.abstractmethod
    def alltoall(self, buf: Buffer, send_rows: Sequence[int], recv_rows: Sequence[int]) -> Buffer:
        """Send ``send_rows[r]`` consecutive rows of ``buf`` to rank r; return received rows."""

    def gather_vectors(self, vector: np.ndarray) -> np.ndarray:
        """Every rank's int64 ``vector`` (the same length on all ranks) as rows in rank order.

        The engine's negotiation round. Default: :meth:`allgather`; the torch.distributed
        backends use Unix sockets when all ranks share the host (``local_mesh``).
        """
        length = vector.size
        gathered = self.allgather(vector.reshape(1, length), [1] * self.size)
        return np.asarray(gathered, dtype=np.int64).reshape(self.size, length)

    def local_mesh(self) -> LocalMesh | None:
        """The :class:`~.local_mesh.LocalMesh` of this group when it has one (default: None).

        Its :meth:`~.local_mesh.LocalMesh.exchange` lets a caller holding the engine's
        execution lock send raw data to every rank without a negotiation round (the
        ``DistributedOptimizer``'s steady state); the mesh's void rounds keep it in step with
        ranks that negotiate instead.
        """
        return None

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def reducescatter(self, buf: Buffer, op: ReduceOp, rows: Sequence[int]) -> Buffer:
        """Reduce ``buf`` and return this rank's block of ``rows[rank]`` rows."""
        work = buf.clone() if hasattr(buf, "clone") else np.array(buf, copy=True)
        self.allreduce(work, op)
        start = sum(rows[: self.rank])
        return work[start : start + rows[self.rank]]

    # -- objects -----------------------------------------------------------------------------
    def allgather_object(self, obj: T) -> list[T]:
        """Gather a picklable object from every rank, in rank order."""
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = self.allgather(np.array([payload.size], dtype=np.int64), [1] * self.size)
        gathered = self.allgather(payload.copy(), [int(n) for n in sizes])
        out, offset = [], 0
        for n in (int(x) for x in sizes):
            out.append(pickle.loads(np.asarray(gathered)[offset : offset + n].tobytes()))
            offset += n
        return out

    def broadcast_object(self, obj: T, root: int) -> T:
        """Return ``root``'s object on every rank."""
        payload = b""
        if self.rank == root:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = np.array([len(payload)], dtype=np.int64)
        self.broadcast(size, root)
        buf = np.zeros(int(size[0]), dtype=np.uint8)
        if self.rank == root:
            buf[:] = np.frombuffer(payload, np.uint8)
        self.broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    # -- join support ------------------------------------------------------------------------
    def zeros(self, numel: int, dtype: str, device: str) -> Buffer:
        """A zero buffer a joined rank contributes to the others' allreduce."""
        if device != "cpu":
            raise ConfigurationError(f"backend {self.name!r} has no device {device!r}")
        return np.zeros(numel, dtype=np.dtype(dtype))


# name -> Backend subclass, or "module:Class" imported on first use (keeps torch/mpi4py lazy).
_REGISTRY: dict[str, type[Backend] | str] = {
    "gloo": "spark_estimators.collective.backends.torch_distributed:GlooBackend",
    "nccl": "spark_estimators.collective.backends.torch_distributed:NcclBackend",
    "mpi": "spark_estimators.collective.backends.mpi:MPIBackend",
}


def register_backend(name: str, backend: type[Backend] | str) -> None:
    """Make ``init(backend=name)`` use ``backend`` (a class or a lazy ``"module:Class"``)."""
    if not name or name == "auto":
        raise ConfigurationError(f"backend name {name!r} is reserved")
    _REGISTRY[name] = backend


def registered_backends() -> list[str]:
    """Names :func:`backend_class` accepts (some may fail to import if not installed)."""
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name``, importing it on first use."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigurationError(
            f"collective backend {name!r} is unknown; choose one of "
            f"{', '.join(['auto', *registered_backends()])}"
        )
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            extra = "mpi" if name == "mpi" else "torch"
            raise ConfigurationError(
                f"collective backend {name!r} is not available ({exc}); install it with "
                f"pip install 'spark-estimators[{extra}]'"
            ) from exc
        entry = getattr(module, attr)
        _REGISTRY[name] = entry
    assert isinstance(entry, type)
    return entry


__all__ = [
    "DTYPES",
    "Backend",
    "Buffer",
    "ReduceOp",
    "Topology",
    "backend_class",
    "dtype_code",
    "register_backend",
    "registered_backends",
    "resolve_op",
]
