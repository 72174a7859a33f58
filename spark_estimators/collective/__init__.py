"""Horovod-style collective API, framework-agnostic core: ``init``, ``rank``, ``size``, numpy ops.

The same calls work inside :func:`spark_estimators.run`, inside estimator training code, under
``python -m spark_estimators.launch -np N script.py`` and under ``torchrun``. For torch tensors,
``DistributedOptimizer`` and the rest of ``horovod.torch`` use
:mod:`spark_estimators.collective.torch` (``import spark_estimators.collective.torch as hvd``).

This module imports no deep-learning framework: the ops here take numpy arrays, and the
backend (``gloo``/``nccl`` over torch.distributed, or ``mpi``) is imported by :func:`init`.

>>> import numpy as np
>>> import spark_estimators.collective as hvd
>>> hvd.init()  # doctest: +SKIP
>>> hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum)  # doctest: +SKIP
array([2., 2., 2.], dtype=float32)
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_estimators.collective import engine as _engine
from spark_estimators.collective import ops as _ops
from spark_estimators.collective import process_sets as _process_sets
from spark_estimators.collective import settings as _settings
from spark_estimators.collective import timeline as _timeline
from spark_estimators.collective.backend import (
    Backend,
    ReduceOp,
    Topology,
    backend_class,
    register_backend,
)
from spark_estimators.collective.engine import Handle
from spark_estimators.collective.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from spark_estimators.collective.timeline import start_timeline, stop_timeline
from spark_estimators.errors import CollectiveError, ConfigurationError

logger = logging.getLogger(__name__)

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM  # allreduce / grouped_allreduce / torch DistributedOptimizer
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_NUMPY = _ops.NumpyOps()
_atexit_registered = False


# -- lifecycle -------------------------------------------------------------------------------
def init(
    backend: str | None = None,
    *,
    comm: Any = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
    timeline: str | None = None,
) -> None:
    """Join the collective group of this job; call once per process before any op.

    Parameters
    ----------
    backend
        ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"auto"`` (under ``mpiexec``: mpi; else nccl when
        this rank has a CUDA device, else gloo). Default: ``SPARK_ESTIMATORS_BACKEND`` (set by
        the launchers), else auto.
    comm
        MPI only, as ``hvd.init(comm=...)``: an mpi4py intracommunicator, or a list of
        ``COMM_WORLD`` ranks, to run the collectives on instead of ``COMM_WORLD``; rank, size
        and local ranks are then this communicator's. Implies ``backend="mpi"``.
    start_timeout
        Seconds to wait for every rank at the rendezvous; default
        ``SPARK_ESTIMATORS_START_TIMEOUT`` (60).
    timeout
        Seconds an op waits for its peers before raising; default
        ``SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT`` (120).
    process_sets
        :class:`ProcessSet` objects to register right away (the same list on every rank), as
        Horovod's static process sets; ``"dynamic"`` is accepted (sets can always be added
        later with :func:`add_process_set`).
    timeline
        Write this rank's timeline (Chrome trace JSON of every op and its negotiation) to this
        path, ``.rank<N>`` added before the extension (or ``{rank}`` replaced); default
        ``SPARK_ESTIMATORS_TIMELINE``, else ``HOROVOD_TIMELINE``. See
        :mod:`spark_estimators.collective.timeline`.

    Raises
    ------
    ConfigurationError
        Bad backend name or environment.
    RendezvousTimeoutError
        Not every rank reached the rendezvous within ``start_timeout``.

    Notes
    -----
    Calling ``init()`` again while initialised does nothing (as in Horovod).
    """
    global _atexit_registered
    with _engine.lock():
        if _engine.current() is not None:
            return
        if isinstance(process_sets, str) and process_sets != "dynamic":
            raise ConfigurationError(
                f"init(process_sets={process_sets!r}): pass a list of ProcessSet objects or "
                "'dynamic'"
            )
        requested = _settings.requested_backend(backend)
        extra: dict[str, Any] = {}
        if comm is not None:
            if backend not in (None, "auto", "mpi"):
                raise ConfigurationError(
                    f"init(comm=...) is an MPI communicator, but backend={backend!r}; use "
                    "backend='mpi' (or leave it out)"
                )
            requested, extra = "mpi", {"comm": comm}
        name = _settings.resolve_backend(requested)
        # The MPI backend takes its rank and size from the communicator: no rendezvous address.
        topology = _settings.topology_from_env(rendezvous=name != "mpi")
        cls = backend_class(name)
        impl = cls(
            topology,
            timeout=_settings.collective_timeout(timeout),
            start_timeout=_settings.start_timeout(start_timeout),
            **extra,
        )
        impl.start()
        engine = _engine.Engine(impl)
        path = _settings.timeline_path(timeline)
        if path:
            engine.timeline = _timeline.Timeline(path, impl.topology.rank)
        engine.start()
        _engine.install(engine)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        topology = impl.topology  # the MPI backend may have refined it
        log = logger.info if topology.rank == 0 else logger.debug
        log("collective init: rank %d of %d, backend %s", topology.rank, topology.size, name)
        for var, why in _settings.ignored_horovod_variables().items():
            (logger.warning if topology.rank == 0 else logger.debug)(
                "%s is set but has no effect in spark_estimators: %s", var, why
            )
        if process_sets is not None and not isinstance(process_sets, str):
            for ps in process_sets:
                add_process_set(ps)


def shutdown() -> None:
    """Leave the collective group (no-op when not initialised); ``init()`` may follow."""
    with _engine.lock():
        engine = _engine.current()
        if engine is None:
            return
        _process_sets.shutdown_all()
        _engine.install(None)
        stopped = engine.stop(timeout=engine.backend.timeout + 5.0)
        if engine.timeline is not None:
            engine.timeline.close()
        if stopped:
            engine.backend.shutdown()
        else:
            logger.warning("collective engine still busy at shutdown; group left as is")


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _engine.current() is not None


def _topology(op: str) -> Topology:
    return _engine.require(op).backend.topology


def rank() -> int:
    """Rank of this process, ``0 .. size() - 1``."""
    return _topology("rank").rank


def size() -> int:
    """Number of ranks in the job."""
    return _topology("size").size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _topology("local_rank").local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _topology("local_size").local_size


def cross_rank() -> int:
    """Rank among the processes with this ``local_rank`` across hosts (the host index)."""
    return _topology("cross_rank").cross_rank


def cross_size() -> int:
    """Number of processes with this ``local_rank`` across hosts (the number of hosts)."""
    return _topology("cross_size").cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    topo = _topology("is_homogeneous")
    return topo.local_size * topo.cross_size == topo.size


def backend_name() -> str:
    """Name of the active backend (``"gloo"``, ``"nccl"``, ``"mpi"``)."""
    return _engine.require("backend_name").backend.name


def mpi_threads_supported() -> bool:
    """True only when the MPI backend is active with ``MPI_THREAD_MULTIPLE``."""
    return _engine.require("mpi_threads_supported").backend.mpi_threads_supported()


def mpi_enabled() -> bool:
    """True when the MPI backend is active."""
    return is_initialized() and backend_name() == "mpi"


def gloo_enabled() -> bool:
    """True when the Gloo backend is active (also the CPU half of ``nccl``)."""
    return is_initialized() and backend_name() in ("gloo", "nccl")


def nccl_built() -> bool:
    """True when torch has NCCL (a CUDA build)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_nccl_available())


def gloo_built() -> bool:
    """True when torch has Gloo."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_gloo_available())


def mpi_built() -> bool:
    """True when mpi4py is importable."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


# -- numpy ops -------------------------------------------------------------------------------
def _array(x: Any, op: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise CollectiveError(
            f"spark_estimators.collective.{op} takes numpy arrays, got {type(x).__name__}; for "
            "torch tensors use spark_estimators.collective.torch"
        )
    return x


def _writable(x: Any, op: str) -> np.ndarray:
    arr = _array(x, op)
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        raise CollectiveError(f"{op} works in place and needs a writable C-contiguous array")
    return arr


def synchronize(handle: Handle) -> Any:
    """Wait for an async op and return its result (raises the op's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the async op has finished (:func:`synchronize` will not block)."""
    return handle.done()


def allreduce_async_(
    array: np.ndarray,
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    average: bool | None = None,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start an in-place allreduce of a writable C-contiguous array; see :func:`allreduce`."""
    return _allreduce_handle(
        array, op, name, prescale_factor, postscale_factor, average, False, process_set
    )


def _allreduce_handle(
    array: np.ndarray,
    op: ReduceOp | None,
    name: str | None,
    prescale_factor: float,
    postscale_factor: float,
    average: bool | None,
    blocking: bool,
    process_set: ProcessSet | None = None,
) -> Handle:
    arr = _writable(array, "allreduce_")
    resolved = _ops_resolve(op, average)
    future = _ops.allreduce(
        _NUMPY, [arr], [arr], resolved, name, prescale_factor, postscale_factor, blocking,
        process_set,
    )  # fmt: skip
    return Handle([future], name or "allreduce", lambda results: results[0][0])


def allreduce_(
    array: np.ndarray,
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    average: bool | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Allreduce a writable C-contiguous array in place and return it.

    This is the entry point for framework buffers (e.g. the Keras adapter's fused gradient
    buffer): no copy is made.
    """
    handle = _allreduce_handle(
        array, op, name, prescale_factor, postscale_factor, average, True, process_set
    )
    return handle.wait()  # type: ignore[no-any-return]


def allreduce(
    array: np.ndarray,
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    average: bool | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Reduce ``array`` across ranks and return the result (the input is not modified).

    Parameters
    ----------
    array
        Same dtype and shape on every rank.
    op
        ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``
        (power-of-two number of ranks, floating dtypes).
    name
        Name used in error messages; must be the same on every rank when given.
    prescale_factor, postscale_factor
        Multiply the input before / the result after the reduction (floating dtypes only).
    average
        Deprecated Horovod flag: ``False`` means ``Sum``.
    process_set
        Reduce among this :class:`ProcessSet`'s members only (default: every rank).

    Returns
    -------
    numpy.ndarray
        ``postscale * reduce(prescale * array)`` (Average divides by ``size()``).
    """
    arr = _array(array, "allreduce")
    out = np.array(arr, copy=True, order="C")
    return allreduce_(out, op, name, prescale_factor, postscale_factor, average, process_set)


def grouped_allreduce(
    arrays: Sequence[np.ndarray],
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[np.ndarray]:
    """Reduce several arrays in one fused operation per dtype; returns new arrays."""
    outs = [np.array(_array(a, "grouped_allreduce"), copy=True, order="C") for a in arrays]
    return grouped_allreduce_(outs, op, name, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    arrays: Sequence[np.ndarray],
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[np.ndarray]:
    """In-place :func:`grouped_allreduce`."""
    arrs = [_writable(a, "grouped_allreduce_") for a in arrays]
    resolved = _ops_resolve(op, None)
    futures = []
    groups = _by_dtype(arrs)
    for i, group in enumerate(groups):
        label = None if name is None else f"{name}.{i}"
        future = _ops.allreduce(
            _NUMPY,
            group,
            group,
            resolved,
            label,
            prescale_factor,
            postscale_factor,
            blocking=len(groups) == 1,
            process_set=process_set,
        )
        futures.append(future)
    for future in futures:
        future.result()
    return arrs


def _by_dtype(arrays: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    groups: dict[str, list[np.ndarray]] = {}
    for a in arrays:
        groups.setdefault(a.dtype.name, []).append(a)
    return list(groups.values())


def allgather(
    array: np.ndarray, name: str | None = None, process_set: ProcessSet | None = None
) -> np.ndarray:
    """Concatenate every rank's array on the first dimension (which may differ)."""
    arr = _array(array, "allgather")
    return _ops.allgather(_NUMPY, arr, name, True, process_set).result()


def broadcast(
    array: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Return ``root_rank``'s array on every rank (the input is not modified).

    ``root_rank`` is a global rank, also with a ``process_set`` (it must be a member).
    """
    arr = _array(array, "broadcast")
    out = np.array(arr, copy=True, order="C")
    return _ops.broadcast(_NUMPY, out, out, root_rank, name, True, process_set).result()


def broadcast_(
    array: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Overwrite a writable array with ``root_rank``'s, in place, and return it."""
    arr = _writable(array, "broadcast_")
    return _ops.broadcast(_NUMPY, arr, arr, root_rank, name, True, process_set).result()


def alltoall(
    array: np.ndarray,
    splits: Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Send ``splits[r]`` rows to rank r and receive theirs, concatenated in rank order.

    Returns the received array, and with ``splits`` given also the received row counts.
    """
    arr = _array(array, "alltoall")
    future = _ops.alltoall(_NUMPY, arr, splits, name, True, process_set)
    out, received = future.result()
    return out if splits is None else (out, received)


def reducescatter(
    array: np.ndarray,
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Reduce across ranks; rank r gets block r of the first dimension (first ranks get more)."""
    resolved = _ops_resolve(op, None, adasum=False)
    arr = _array(array, "reducescatter")
    future = _ops.reducescatter(
        _NUMPY, arr, resolved, name, prescale_factor, postscale_factor, True, process_set
    )
    return np.asarray(future.result())


def barrier(process_set: ProcessSet | None = None) -> None:
    """Block until every rank (of ``process_set``) has called ``barrier()``."""
    _ops.barrier(True, process_set).result()


def join() -> int:
    """Declare this rank done; help others' allreduces with zeros until all joined.

    Returns
    -------
    int
        The rank that joined last.
    """
    return int(_ops.join(blocking=True).result())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = None
) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return list(_ops.allgather_object(obj, name, True, process_set).result())


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank."""
    return _ops.broadcast_object(obj, root_rank, name, True, process_set).result()


def _ops_resolve(
    op: ReduceOp | int | None, average: bool | None, *, adasum: bool = True
) -> ReduceOp:
    from spark_estimators.collective.backend import resolve_op

    return resolve_op(op, average, adasum=adasum)


__all__ = [
    "Adasum",
    "Average",
    "Backend",
    "Handle",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "Topology",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async_",
    "alltoall",
    "backend_name",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allreduce",
    "grouped_allreduce_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "register_backend",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
