"""Torch collective reductions (allreduce, grouped allreduce), Horovod's names and semantics.

Users import them through :mod:`spark_estimators.collective.torch`. Every op is submitted to the
collective engine (see :mod:`spark_estimators.collective.runtime.engine`); the blocking form
is the async form followed by :func:`synchronize`. Out-of-place ``allreduce`` and
``grouped_allreduce`` are differentiable, as in Horovod: the gradient is the same reduction
(op and scale factors) of the incoming gradients. The ops that move data are in
:mod:`.exchange`.

Each reduction is written once: the two grouped async starters (in place or into new tensors);
the one-tensor forms are the grouped ones on ``[tensor]`` (:func:`_per_tensor`) and the blocking
in-place forms wait for the async ones (:func:`~spark_estimators.collective.runtime.forms.
synchronized`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import allreduce as _allreduce
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime.allreduce import Reduction
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.forms import named, synchronized
from spark_estimators.collective.runtime.futures import FuturesHandle, Handle
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

_R = TypeVar("_R")
_S = TypeVar("_S")


def synchronize(handle: Handle) -> object:
    """Wait for an async op and return its output (raises the op's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the async op has finished."""
    return handle.poll()


# -- allreduce -------------------------------------------------------------------------------
def _grouped_allreduce_async(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    reduction: Reduction,
    name: str | None,
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
        call = Call(name, in_waited_ops(), process_set)
        one = _allreduce.allreduce(_TORCH, inputs, outputs, reduction, call)
        return FuturesHandle([one], name or "grouped_allreduce", finish)
    futures: list[Future[Sequence[torch.Tensor]]] = []
    groups = dtype_device_groups(inputs)
    for g, idx in enumerate(groups):
        label = name if name is None or len(groups) == 1 else f"{name}.{g}"
        futures.append(
            _allreduce.allreduce(
                _TORCH,
                [inputs[i] for i in idx],
                [outputs[i] for i in idx],
                reduction,
                Call(label, in_waited_ops() and len(groups) == 1, process_set),
            )
        )
    return FuturesHandle(futures, name or "grouped_allreduce", finish)


def _grouped_allreduce_start(in_place: bool, what: str, doc: str) -> Callable[..., Handle]:
    """``grouped_allreduce_async_`` (``in_place``: returns ``tensors``) or its out-of-place form."""

    def start(
        tensors: Sequence[torch.Tensor],
        average: bool | None = None,
        name: str | None = None,
        op: ReduceOp | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: ProcessSet | None = None,
    ) -> Handle:
        ts = [as_tensor(t, what) for t in tensors]
        outs = (
            ts
            if in_place
            else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts]
        )
        result = list(tensors) if in_place else outs
        return _grouped_allreduce_async(
            ts, outs, Reduction(resolve_op(op, average, adasum=True), prescale_factor,
                                postscale_factor),
            name, lambda results: result, process_set,
        )  # fmt: skip

    return named(start, what, doc)


def _first(results: Sequence[torch.Tensor]) -> torch.Tensor:
    return results[0]


def _first_when_done(handle: Handle) -> Handle:
    return handle.then(_first)


def _per_tensor(
    grouped: Callable[..., _R],
    first: Callable[[_R], _S],
    what: str,
    doc: str,
    module: str = __name__,
) -> Callable[..., _S]:
    """The one-tensor form of the op ``grouped``: ``first`` of ``grouped([tensor], ...)``.

    ``module``: the module that publishes the form (pickle looks it up there by name).
    """

    def one(tensor: torch.Tensor, *args: object, **kwargs: object) -> _S:
        if not isinstance(tensor, torch.Tensor):
            as_tensor(tensor, what)  # a wrong argument's error names the op called
        return first(grouped([tensor], *args, **kwargs))

    signature = inspect.signature(grouped)
    tensors, *rest = signature.parameters.values()
    signature = signature.replace(
        parameters=[tensors.replace(name="tensor", annotation="torch.Tensor"), *rest],
        return_annotation=inspect.signature(first).return_annotation,
    )
    return named(one, what, doc, signature, module=module)


grouped_allreduce_async_ = _grouped_allreduce_start(
    True,
    "grouped_allreduce_async_",
    "Start an in-place fused allreduce of ``tensors`` (one op per dtype and device).",
)
grouped_allreduce_async = _grouped_allreduce_start(
    False, "grouped_allreduce_async", "Start a fused allreduce of ``tensors`` into new tensors."
)
grouped_allreduce_ = waited(
    synchronized(
        grouped_allreduce_async_,
        list[torch.Tensor],
        "grouped_allreduce_",
        "In-place :func:`grouped_allreduce`; returns the same tensors.",
    )
)
_fallback_allreduce_async_ = _per_tensor(
    grouped_allreduce_async_,
    _first_when_done,
    "allreduce_async_",
    "Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`.",
)
_RESOLVED: dict[tuple[object, object], ReduceOp] = {}


def _allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    # The hot path of per-gradient allreduces (DistributedOptimizer's pattern): one contiguous
    # tensor goes straight to allreduce_one; anything else takes the grouped form.
    try:
        resolved = _RESOLVED[op, average]
    except (KeyError, TypeError):
        resolved = resolve_op(op, average, adasum=True)  # raises for a bad op
        if len(_RESOLVED) < 64:
            _RESOLVED[op, average] = resolved
    if (
        not isinstance(tensor, torch.Tensor)
        or resolved is ReduceOp.ADASUM
        or not tensor.is_contiguous()
    ):
        return _fallback_allreduce_async_(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )  # fmt: skip
    x = tensor.detach() if tensor.requires_grad else tensor
    return _allreduce.allreduce_one(
        _engine.require("allreduce", process_set), _TORCH, x, resolved, prescale_factor,
        postscale_factor, name, in_waited_ops(), tensor,
    )  # fmt: skip


allreduce_async_ = named(
    _allreduce_async_,
    "allreduce_async_",
    "Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`.",
    inspect.signature(_fallback_allreduce_async_),
)
allreduce_async = _per_tensor(
    grouped_allreduce_async,
    _first_when_done,
    "allreduce_async",
    "Start an allreduce into a new tensor; the input is not modified.",
)
allreduce_ = waited(
    synchronized(
        allreduce_async_,
        torch.Tensor,
        "allreduce_",
        "Allreduce ``tensor`` in place across ranks and return it; see :func:`allreduce`.",
    )
)


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


allreduce = _per_tensor(
    grouped_allreduce,
    _first,
    "allreduce",
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
    """,
)
