"""Torch collective reductions (allreduce, grouped allreduce), Horovod's names and semantics.

Users import them through :mod:`spark_estimators.collective.torch`. Every op is submitted to the
collective engine (see :mod:`spark_estimators.collective.runtime.engine`); the blocking form
is the async form followed by :func:`synchronize`. Out-of-place ``allreduce`` and
``grouped_allreduce`` are differentiable, as in Horovod: the gradient is the same reduction
(op and scale factors) of the incoming gradients. The ops that move data are in
:mod:`.exchange`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import allreduce as _allreduce
from spark_estimators.collective.runtime.futures import Handle
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.collective.torch.arrays import (
    _TORCH,
    Grads,
    OpContext,
    as_tensor,
    dtype_device_groups,
    in_waited_ops,
    waited,
)
from spark_estimators.collective.torch.compression import (
    Compression,
    Compressor,
    compressed_apply,
)
from spark_estimators.errors import CollectiveError


def synchronize(handle: Handle) -> object:
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
    finish: Callable[[list[object]], object],
    process_set: ProcessSet | None = None,
) -> Handle:
    if len(inputs) > 1 and len({t.device.type for t in inputs}) > 1:
        # Horovod refuses this too (its test_horovod_grouped_allreduce_cpu_gpu_error).
        raise CollectiveError(
            f"grouped allreduce {name or ''!r} mixes CPU and GPU tensors; move them to one device "
            "or call grouped_allreduce once per device"
        )
    if len(inputs) == 1:  # allreduce_async_ per tensor (a hot path): nothing to group
        one = _allreduce.allreduce(_TORCH, inputs, outputs, op, name, prescale_factor,
                                   postscale_factor, blocking=in_waited_ops(),
                                   process_set=process_set)  # fmt: skip
        return Handle([one], name or "grouped_allreduce", finish)
    futures: list[Future[Sequence[torch.Tensor]]] = []
    groups = dtype_device_groups(inputs)
    for g, idx in enumerate(groups):
        label = name if name is None or len(groups) == 1 else f"{name}.{g}"
        futures.append(
            _allreduce.allreduce(
                _TORCH,
                [inputs[i] for i in idx],
                [outputs[i] for i in idx],
                op,
                label,
                prescale_factor,
                postscale_factor,
                blocking=in_waited_ops() and len(groups) == 1,
                process_set=process_set,
            )
        )
    return Handle(futures, name or "grouped_allreduce", finish)


def _start(
    tensors: Sequence[torch.Tensor],
    in_place: bool,
    what: str,
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet | None,
) -> Handle:
    """The four async allreduces: in place (returns ``tensors``) or into new tensors."""
    ts = [as_tensor(t, what) for t in tensors]
    outs = (
        ts if in_place else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts]
    )
    result = list(tensors) if in_place else outs
    return _grouped_allreduce_async(
        ts, outs, resolve_op(op, average, adasum=True), name, prescale_factor, postscale_factor,
        (lambda results: result) if what.startswith("grouped") else (lambda results: result[0]),
        process_set,
    )  # fmt: skip


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`."""
    return _start([tensor], True, "allreduce_async_", average, name, op, prescale_factor,
                  postscale_factor, process_set)  # fmt: skip


@waited
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Allreduce ``tensor`` in place across ranks and return it; see :func:`allreduce`."""
    return _start([tensor], True, "allreduce_", average, name, op, prescale_factor,
                  postscale_factor, process_set).wait()  # fmt: skip


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start an allreduce into a new tensor; the input is not modified."""
    return _start([tensor], False, "allreduce_async", average, name, op, prescale_factor,
                  postscale_factor, process_set)  # fmt: skip


@waited
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
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
    (out,) = grouped_allreduce(
        [tensor], average, name, compression, op, prescale_factor, postscale_factor, process_set
    )
    return out


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start an in-place fused allreduce of ``tensors`` (one op per dtype and device)."""
    return _start(tensors, True, "grouped_allreduce_async_", average, name, op, prescale_factor,
                  postscale_factor, process_set)  # fmt: skip


@waited
def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _start(tensors, True, "grouped_allreduce_", average, name, op, prescale_factor,
                  postscale_factor, process_set).wait()  # fmt: skip


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start a fused allreduce of ``tensors`` into new tensors."""
    return _start(tensors, False, "grouped_allreduce_async", average, name, op, prescale_factor,
                  postscale_factor, process_set)  # fmt: skip


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    @waited
    def forward(
        ctx: OpContext,
        op: ReduceOp,
        name: str | None,
        pre: float,
        post: float,
        process_set: ProcessSet | None,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        handle = grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)
        return tuple(handle.wait())

    @staticmethod
    @waited
    def backward(ctx: OpContext, *grads: torch.Tensor) -> Grads:
        # Horovod's rule: the gradients go through the same grouped reduction. Backward on one
        # output at a time is fine: autograd passes zeros for the others, on every rank alike.
        reduced = grouped_allreduce_async(
            [g.contiguous() for g in grads], None, None, ctx.op, ctx.pre, ctx.post, ctx.process_set
        ).wait()
        return (None, None, None, None, None, *reduced)


@waited
def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Reduce several tensors as one fused operation (per dtype and device); new tensors.

    This is what tensor fusion does for Horovod: one negotiation and one backend reduction for
    the whole group instead of one per tensor. Differentiable when a tensor requires grad.
    """
    resolved = resolve_op(op, average, adasum=True)
    return compressed_apply(
        tensors,
        compression,
        lambda sent: _GroupedAllreduceFunction.apply(
            resolved, name, prescale_factor, postscale_factor, process_set, *sent
        ),
        lambda sent: grouped_allreduce_async(
            sent, None, name, resolved, prescale_factor, postscale_factor, process_set
        ).wait(),
    )
