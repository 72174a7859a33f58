"""Collective ops on torch tensors, with Horovod's names, arguments and semantics.

Users import them through :mod:`spark_estimators.collective.torch`. Every op is submitted to the
collective engine (see :mod:`spark_estimators.collective.runtime.engine`); the blocking form
is the async form followed by :func:`synchronize`. Out-of-place ``allreduce``, ``allgather`` and
``broadcast`` are differentiable, as in Horovod.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import ops as _ops
from spark_estimators.collective.runtime.engine import Handle
from spark_estimators.collective.torch.arrays import _TORCH, TorchOps  # noqa: F401
from spark_estimators.collective.torch.compression import Compression, Compressor
from spark_estimators.errors import ConfigurationError


# -- helpers ---------------------------------------------------------------------------------
def _tensor(x: Any, op: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ConfigurationError(f"{op} takes a torch.Tensor, got {type(x).__name__}")
    return x.detach()


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


# Set while a blocking function runs: the ops it starts are waited for at once, so the engine
# may run them in this thread when it is idle (see Engine.submit).
_local = threading.local()
_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def waited_ops() -> Iterator[None]:
    """Ops started inside are waited for right away: run them in this thread when it can.

    The engine then skips the hand-off to its thread (two thread wake-ups per op, which cost
    more than a small op itself on a busy machine).
    """
    previous = getattr(_local, "blocking", False)
    _local.blocking = True
    try:
        yield
    finally:
        _local.blocking = previous


def _waited(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with waited_ops():
            return fn(*args, **kwargs)

    return wrapper


def _blocking() -> bool:
    return bool(getattr(_local, "blocking", False))


def synchronize(handle: Handle) -> Any:
    """Wait for an async op and return its output (raises the op's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the async op has finished."""
    return handle.done()


# -- allreduce -------------------------------------------------------------------------------
def _grouped_allreduce_async(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    op: ReduceOp,
    name: str | None,
    prescale_factor: float,
    postscale_factor: float,
    finish: Any,
    process_set: Any = None,
) -> Handle:
    futures: list[Future[Any]] = []
    groups = _groups(inputs)
    for g, idx in enumerate(groups):
        label = name if name is None or len(groups) == 1 else f"{name}.{g}"
        futures.append(
            _ops.allreduce(
                _TORCH,
                [inputs[i] for i in idx],
                [outputs[i] for i in idx],
                op,
                label,
                prescale_factor,
                postscale_factor,
                blocking=_blocking() and len(groups) == 1,
                process_set=process_set,
            )
        )
    return Handle(futures, name or "grouped_allreduce", finish)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`."""
    t = _tensor(tensor, "allreduce_async_")
    return _grouped_allreduce_async(
        [t],
        [t],
        resolve_op(op, average, adasum=True),
        name,
        prescale_factor,
        postscale_factor,
        lambda results: tensor,
        process_set,
    )


@_waited
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Allreduce ``tensor`` in place across ranks and return it; see :func:`allreduce`."""
    return allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    ).wait()


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start an allreduce into a new tensor; the input is not modified."""
    t = _tensor(tensor, "allreduce_async")
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    return _grouped_allreduce_async(
        [t],
        [out],
        resolve_op(op, average, adasum=True),
        name,
        prescale_factor,
        postscale_factor,
        lambda results: out,
        process_set,
    )


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    @_waited
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        name: str | None,
        pre: float,
        post: float,
        process_set: Any,
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return allreduce_async(tensor, None, name, op, pre, post, process_set).wait()

    @staticmethod
    @_waited
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce_async(
            grad.contiguous(), None, None, ctx.op, ctx.pre, ctx.post, ctx.process_set
        )
        return reduced.wait(), None, None, None, None, None


@_waited
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Reduce ``tensor`` across all ranks and return the result in a new tensor.

    Parameters
    ----------
    tensor
        Same dtype and shape on every rank.
    average
        Deprecated Horovod flag (``False`` = Sum); use ``op``.
    name
        Name used in error messages; the same on every rank when given.
    compression
        ``Compression.none`` (default) or ``Compression.fp16``.
    op
        ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum`` (a
        power-of-two number of ranks, floating dtypes).
    prescale_factor, postscale_factor
        Multiply the input before / the result after the reduction.
    process_set
        Reduce among this ``ProcessSet``'s members only (default: every rank).

    Returns
    -------
    torch.Tensor
        ``postscale * reduce(prescale * tensor)``; differentiable when ``tensor`` requires grad.

    Examples
    --------
    >>> import spark_estimators.collective.torch as hvd
    >>> hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum)  # doctest: +SKIP
    tensor([3., 3.])
    """
    resolved = resolve_op(op, average, adasum=True)
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _AllreduceFunction.apply(
            compressed, resolved, name, prescale_factor, postscale_factor, process_set
        )
    else:
        out = allreduce_async(
            compressed, None, name, resolved, prescale_factor, postscale_factor, process_set
        ).wait()
    return compression.decompress(out, ctx)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start an in-place fused allreduce of ``tensors`` (one op per dtype and device)."""
    ts = [_tensor(t, "grouped_allreduce_async_") for t in tensors]
    originals = list(tensors)
    return _grouped_allreduce_async(
        ts,
        ts,
        resolve_op(op, average, adasum=True),
        name,
        prescale_factor,
        postscale_factor,
        lambda results: originals,
        process_set,
    )


@_waited
def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    ).wait()


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start a fused allreduce of ``tensors`` into new tensors."""
    ts = [_tensor(t, "grouped_allreduce_async") for t in tensors]
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts]
    return _grouped_allreduce_async(
        ts,
        outs,
        resolve_op(op, average, adasum=True),
        name,
        prescale_factor,
        postscale_factor,
        lambda results: outs,
        process_set,
    )


@_waited
def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduce several tensors as one fused operation (per dtype and device); new tensors.

    This is what tensor fusion does for Horovod: one negotiation and one backend reduction for
    the whole group instead of one per tensor.
    """
    compressed = [compression.compress(t) for t in tensors]
    outs = grouped_allreduce_async(
        [c for c, _ in compressed],
        None,
        name,
        resolve_op(op, average, adasum=True),
        prescale_factor,
        postscale_factor,
        process_set,
    ).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# -- allgather / broadcast / alltoall / reducescatter ----------------------------------------
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> Handle:
    """Start an allgather; see :func:`allgather`."""
    t = _tensor(tensor, "allgather_async")
    future = _ops.allgather(_TORCH, t, name, _blocking(), process_set)
    return Handle([future], name or "allgather")


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    @_waited
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.dim0, ctx.process_set = tensor.shape[0], process_set
        return allgather_async(tensor, name, process_set).wait()

    @staticmethod
    @_waited
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        reduced = allreduce_async(grad.contiguous(), op=ReduceOp.SUM, process_set=ps).wait()
        dims = allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64), None, ps).wait()
        offset = int(dims[: _engine.require("allgather", ps).backend.rank].sum())
        return reduced.narrow(0, offset, ctx.dim0), None, None


@_waited
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank on dim 0; the first dimension may differ.

    Returns
    -------
    torch.Tensor
        Shape ``(sum of every rank's dim 0, *tensor.shape[1:])``, in rank order.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFunction.apply(tensor, name, process_set)  # type: ignore[no-any-return]
    return allgather_async(tensor, name, process_set).wait()  # type: ignore[no-any-return]


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> Handle:
    """Start an in-place broadcast from ``root_rank``."""
    t = _tensor(tensor, "broadcast_async_")
    future = _ops.broadcast(_TORCH, t, t, root_rank, name, _blocking(), process_set)
    return Handle([future], name or "broadcast", lambda results: tensor)


@_waited
def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> Handle:
    """Start a broadcast into a new tensor."""
    t = _tensor(tensor, "broadcast_async")
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    future = _ops.broadcast(_TORCH, t, out, root_rank, name, _blocking(), process_set)
    return Handle([future], name or "broadcast", lambda results: out)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    @_waited
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    @_waited
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        reduced = allreduce_async(grad.contiguous(), op=ReduceOp.SUM, process_set=ps).wait()
        if _engine.require("broadcast").backend.rank != ctx.root_rank:  # global ranks
            reduced.zero_()
        return reduced, None, None, None


@_waited
def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFunction.apply(  # type: ignore[no-any-return]
            tensor, root_rank, name, process_set
        )
    return broadcast_async(tensor, root_rank, name, process_set).wait()  # type: ignore[no-any-return]


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = None,
) -> Handle:
    """Start an alltoall; see :func:`alltoall`."""
    t = _tensor(tensor, "alltoall_async")
    split_list = None if splits is None else [int(s) for s in np.asarray(splits).reshape(-1)]
    future = _ops.alltoall(_TORCH, t, split_list, name, _blocking(), process_set)

    def finish(results: list[Any]) -> Any:
        out, received = results[0]
        if splits is None:
            return out
        return out, torch.from_numpy(np.asarray(received, dtype=np.int32))

    return Handle([future], name or "alltoall", finish)


@_waited
def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = None,
) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; receive every rank's rows for this one.

    Without ``splits`` the first dimension is split evenly (it must divide by ``size()``).

    Returns
    -------
    torch.Tensor or tuple
        The received rows in rank order; with ``splits`` also a tensor of the row counts
        received from each rank (Horovod's second return value).
    """
    return alltoall_async(tensor, splits, name, process_set).wait()


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter; see :func:`reducescatter`."""
    compressed, ctx = compression.compress(_tensor(tensor, "reducescatter_async"))
    future = _ops.reducescatter(
        _TORCH, compressed, resolve_op(op), name, prescale_factor, postscale_factor, _blocking(),
        process_set,
    )  # fmt: skip
    return Handle(
        [future], name or "reducescatter", lambda results: compression.decompress(results[0], ctx)
    )


@_waited
def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks; rank r receives block r of the first dimension.

    Blocks are as even as possible, the first ``dim0 % size()`` ranks get one extra row.
    """
    return reducescatter_async(  # type: ignore[no-any-return]
        tensor, name, compression, op, process_set, prescale_factor, postscale_factor
    ).wait()


def barrier(process_set: Any = None) -> None:
    """Block until every rank (of ``process_set``) has called ``barrier()``."""
    _ops.barrier(True, process_set).result()


def join(device: int = -1) -> int:
    """Declare this rank out of data; contribute zeros to others' allreduces until all join.

    Returns
    -------
    int
        The rank that joined last. ``device`` is accepted for Horovod compatibility: joined
        ranks create their zeros on the device the other ranks' tensors use.
    """
    return int(_ops.join(blocking=True).result())


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return list(_ops.allgather_object(obj, name, True, process_set).result())


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank."""
    return _ops.broadcast_object(obj, root_rank, name, True, process_set).result()
