"""The numpy collective ops of :mod:`spark_estimators.collective` (Horovod's names and arguments).

Every op takes numpy arrays; torch tensors go through :mod:`spark_estimators.collective.torch`.
The ops hand their buffers to the engine (:mod:`spark_estimators.collective.runtime.ops`), which
negotiates them with the other ranks and runs them on the active backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import allreduce as _allreduce
from spark_estimators.collective.runtime import ops as _ops
from spark_estimators.collective.runtime.allreduce import Reduction
from spark_estimators.collective.runtime.arrays import NumpyOps
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.forms import named, out_of_place, synchronized
from spark_estimators.collective.runtime.futures import FuturesHandle, Handle
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.errors import CollectiveError

_NUMPY = NumpyOps()

#: An object sent to every rank and received as the same kind of object.
T = TypeVar("T")


def _array(x: object, op: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise CollectiveError(
            f"spark_estimators.collective.{op} takes numpy arrays, got {type(x).__name__}; for "
            "torch tensors use spark_estimators.collective.torch"
        )
    return x


def _writable(x: object, op: str) -> np.ndarray:
    arr = _array(x, op)
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        raise CollectiveError(f"{op} works in place and needs a writable C-contiguous array")
    return arr


def synchronize(handle: Handle) -> Any:
    """Wait for an async op and return its result (raises the op's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the async op has finished (:func:`synchronize` will not block)."""
    return handle.poll()


def _copy(array: np.ndarray, op: str) -> np.ndarray:
    """A writable C-contiguous copy of ``array`` (an error naming ``op`` for a non-array)."""
    return np.array(_array(array, op), copy=True, order="C")


def _copies(arrays: Sequence[np.ndarray], op: str) -> list[np.ndarray]:
    return [_copy(a, op) for a in arrays]


#: The parameters of the three allreduce forms, for their docstrings.
_ALLREDUCE_PARAMETERS = """Parameters
    ----------
    array
        Same dtype and shape on every rank.
    op
        ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``
        (power-of-two number of ranks, floating dtypes).
    name
        Name used in error messages; must be the same on every rank when given.
    prescale_factor, postscale_factor
        Multiply the input before / the result after the reduction (integers: in float64,
        truncated toward zero, as in Horovod).
    average
        Deprecated Horovod flag: ``False`` means ``Sum``.
    process_set
        Reduce among this :class:`ProcessSet`'s members only (default: every rank).
"""


def _allreduce_start(blocking: bool, what: str, doc: str) -> Callable[..., Handle]:
    """The in-place allreduce of one array, run at once (``blocking``) or queued."""

    def start(
        array: np.ndarray,
        op: ReduceOp | None = None,
        name: str | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        average: bool | None = None,
        process_set: ProcessSet | None = None,
    ) -> Handle:
        arr = _writable(array, what)
        reduction = Reduction(_ops_resolve(op, average), prescale_factor, postscale_factor)
        call = Call(name, blocking, process_set)
        future = _allreduce.allreduce(_NUMPY, [arr], [arr], reduction, call)
        return FuturesHandle([future], name or "allreduce", lambda results: results[0][0])

    return named(start, what, doc)


allreduce_async_ = _allreduce_start(
    False,
    "allreduce_async_",
    f"""Start an in-place allreduce of a writable C-contiguous array; see :func:`allreduce`.

    {_ALLREDUCE_PARAMETERS}
    Returns
    -------
    Handle
        For :func:`synchronize`, which returns ``array`` once it holds the result.
    """,
)
allreduce_ = synchronized(
    _allreduce_start(True, "allreduce_", ""),
    np.ndarray,
    "allreduce_",
    f"""Allreduce a writable C-contiguous array in place and return it.

    This is the entry point for framework buffers (e.g. the Keras adapter's fused gradient
    buffer): no copy is made.

    {_ALLREDUCE_PARAMETERS}
    Returns
    -------
    numpy.ndarray
        ``array``, holding ``postscale * reduce(prescale * array)``.
    """,
)
allreduce = out_of_place(
    allreduce_,
    _copy,
    "allreduce",
    f"""Reduce ``array`` across ranks and return the result (the input is not modified).

    {_ALLREDUCE_PARAMETERS}
    Returns
    -------
    numpy.ndarray
        ``postscale * reduce(prescale * array)`` (Average divides by ``size()``).
    """,
)


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
    reduction = Reduction(_ops_resolve(op, None), prescale_factor, postscale_factor)
    futures = []
    groups = _by_dtype(arrs)
    for i, group in enumerate(groups):
        label = None if name is None else f"{name}.{i}"
        future = _allreduce.allreduce(
            _NUMPY,
            group,
            group,
            reduction,
            Call(label, len(groups) == 1, process_set),
        )
        futures.append(future)
    for future in futures:
        future.result()
    return arrs


grouped_allreduce = out_of_place(
    grouped_allreduce_,
    _copies,
    "grouped_allreduce",
    "Reduce several arrays in one fused operation per dtype; returns new arrays.",
)


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
    return _ops.allgather(_NUMPY, arr, Call(name, True, process_set)).result()


def broadcast_(
    array: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Overwrite a writable array with ``root_rank``'s, in place, and return it."""
    arr = _writable(array, "broadcast_")
    return _ops.broadcast(_NUMPY, arr, arr, root_rank, Call(name, True, process_set)).result()


broadcast = out_of_place(
    broadcast_,
    _copy,
    "broadcast",
    """Return ``root_rank``'s array on every rank (the input is not modified).

    ``root_rank`` is a global rank, also with a ``process_set`` (it must be a member).
    """,
)


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
    future = _ops.alltoall(_NUMPY, arr, splits, Call(name, True, process_set))
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
    reduction = Reduction(_ops_resolve(op, None, adasum=False), prescale_factor, postscale_factor)
    arr = _array(array, "reducescatter")
    future = _ops.reducescatter(_NUMPY, arr, reduction, Call(name, True, process_set))
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
    obj: T, name: str | None = None, process_set: ProcessSet | None = None
) -> list[T]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return list(_ops.allgather_object(obj, Call(name, True, process_set)).result())


def broadcast_object(
    obj: T, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> T:
    """Return ``root_rank``'s picklable ``obj`` on every rank."""
    return _ops.broadcast_object(obj, root_rank, Call(name, True, process_set)).result()


def _ops_resolve(
    op: ReduceOp | int | None, average: bool | None, *, adasum: bool = True
) -> ReduceOp:
    return resolve_op(op, average, adasum=adasum)


__all__ = [
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "grouped_allreduce",
    "grouped_allreduce_",
    "join",
    "poll",
    "reducescatter",
    "synchronize",
]
