"""Grouped allgather and reducescatter, and ``sparse_allreduce_async`` (Horovod's names).

Part of :mod:`spark_estimators.collective.torch`. A grouped op submits one op per tensor, in
list order, under one handle: every rank submits the same ops in the same order, and the engine
may run them back to back. ``grouped_allgather`` and ``grouped_reducescatter`` are
differentiable with Horovod's gradients (those of :func:`.exchange.allgather` and
:func:`.exchange.reducescatter`, tensor by tensor). The reducescatter of one tensor is
``grouped_reducescatter`` of ``[tensor]`` (:func:`.exchange.reducescatter`), so its autograd
function, :class:`ReducescatterFunction`, is here. A group of one tensor keeps the op's name;
larger groups name part i ``{name}.{i}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import ops as _ops
from spark_estimators.collective.runtime.allreduce import Reduction
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.futures import FuturesHandle, Handle
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.collective.torch.arrays import (
    _TORCH,
    Grads,
    OpContext,
    as_tensor,
    in_waited_ops,
    waited,
)
from spark_estimators.collective.torch.compression import (
    Compression,
    Compressor,
    compressed_apply,
)
from spark_estimators.collective.torch.ops import grouped_allreduce_async
from spark_estimators.errors import CollectiveError, ConfigurationError


def _names(name: str | None, n: int) -> list[str | None]:
    """The names of a grouped op's ``n`` parts: ``name`` itself for one (as grouped_allreduce)."""
    if name is None or n == 1:
        return [name] * n
    return [f"{name}.{i}" for i in range(n)]


def _tensors(tensors: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise ConfigurationError(f"{op} takes a list of tensors, got {type(tensors).__name__}")
    return [as_tensor(t, op) for t in tensors]


# -- grouped allgather -----------------------------------------------------------------------
def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Start an allgather of every tensor of ``tensors``; see :func:`grouped_allgather`."""
    ts = _tensors(tensors, "grouped_allgather_async")
    blocking = in_waited_ops()
    futures = [
        _ops.allgather(_TORCH, t, Call(n, blocking, process_set))
        for t, n in zip(ts, _names(name, len(ts)), strict=True)
    ]
    return FuturesHandle(futures, name or "grouped_allgather", lambda results: list(results))


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    @waited
    def forward(
        ctx: OpContext, name: str | None, process_set: ProcessSet | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.dims, ctx.process_set = [int(t.shape[0]) for t in tensors], process_set
        return tuple(grouped_allgather_async(list(tensors), name, process_set).wait())

    @staticmethod
    @waited
    def backward(ctx: OpContext, *grads: torch.Tensor) -> Grads:
        ps = ctx.process_set
        # Horovod: the average over ranks of the gradients, this rank's rows of each.
        reduced = grouped_allreduce_async(
            [g.contiguous() for g in grads], op=ReduceOp.AVERAGE, process_set=ps
        ).wait()
        mine = torch.tensor([ctx.dims], dtype=torch.int64)  # one row: this rank's dim 0s
        dims = grouped_allgather_async([mine], None, ps).wait()[0]
        rank = _engine.require("grouped_allgather", ps).backend.rank
        offsets = dims[:rank].sum(dim=0)
        return (
            None,
            None,
            *(r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, ctx.dims)),
        )


@waited
def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> list[torch.Tensor]:
    """:func:`~spark_estimators.collective.torch.allgather` of every tensor, as one call.

    Returns
    -------
    list of torch.Tensor
        One gathered tensor per input, in order; differentiable when an input requires grad.
    """
    ts = list(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return list(_GroupedAllgatherFunction.apply(name, process_set, *ts))
    return grouped_allgather_async(ts, name, process_set).wait()  # type: ignore[no-any-return]


# -- grouped reducescatter -------------------------------------------------------------------
def _reducescatter_each(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str | None],
    reduction: Reduction,
    process_set: ProcessSet | None,
) -> list[Future[torch.Tensor]]:
    """Submit one reducescatter per tensor, in order (``names[i]`` names tensor i's op)."""
    blocking = in_waited_ops()
    return [
        _ops.reducescatter(_TORCH, t.detach(), reduction, Call(n, blocking, process_set))
        for t, n in zip(tensors, names, strict=True)
    ]


def reducescatter_op(op: ReduceOp | int | None) -> ReduceOp:
    """``op`` resolved for a reducescatter; Adasum raises Horovod's error class.

    Horovod raises ``HorovodInternalError`` (a ``RuntimeError``) for ``op=Adasum`` here; its
    test_torch.py expects that class, which is our :class:`CollectiveError`. Nothing is sent.
    """
    if op is not None and int(op) == ReduceOp.ADASUM:
        raise CollectiveError(
            "op=Adasum is not supported by reducescatter (nor by Horovod's); use op=Average or "
            "op=Sum"
        )
    return resolve_op(op)


def reducescatter_backward(
    grads: Sequence[torch.Tensor],
    op: ReduceOp,
    pre: float,
    post: float,
    process_set: ProcessSet | None,
) -> list[torch.Tensor]:
    """Horovod's reducescatter gradient: scale, then allgather every gradient (in order)."""
    factor = pre * post
    if op is ReduceOp.SUM:
        factor *= _engine.require("reducescatter", process_set).backend.size
    scaled = [(g * factor if factor != 1.0 else g).contiguous() for g in grads]
    return grouped_allgather_async(scaled, None, process_set).wait()  # type: ignore[no-any-return]


class ReducescatterFunction(torch.autograd.Function):
    """Differentiable reducescatter of each tensor (``names[i]`` names tensor i's op)."""

    @staticmethod
    @waited
    def forward(
        ctx: OpContext,
        names: Sequence[str | None],
        op: ReduceOp,
        process_set: ProcessSet | None,
        pre: float,
        post: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Each tensor's block of its reduction across ranks."""
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, pre, post
        reduction = Reduction(op, pre, post)
        futures = _reducescatter_each(list(tensors), names, reduction, process_set)
        return tuple(f.result() for f in futures)

    @staticmethod
    @waited
    def backward(ctx: OpContext, *grads: torch.Tensor) -> Grads:
        """Horovod's gradient (see :func:`reducescatter_backward`)."""
        back = reducescatter_backward(grads, ctx.op, ctx.pre, ctx.post, ctx.process_set)
        return (None, None, None, None, None, *back)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter of every tensor of ``tensors``; see :func:`grouped_reducescatter`."""
    ts = _tensors(tensors, "grouped_reducescatter_async")
    reduction = Reduction(reducescatter_op(op), prescale_factor, postscale_factor)
    futures = _reducescatter_each(ts, _names(name, len(ts)), reduction, process_set)
    return FuturesHandle(futures, name or "grouped_reducescatter", lambda results: list(results))


@waited
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`~spark_estimators.collective.torch.reducescatter` of every tensor, as one call.

    Returns
    -------
    list of torch.Tensor
        This rank's block of each reduced tensor, in order; differentiable when an input
        requires grad.
    """
    resolved = reducescatter_op(op)
    return compressed_apply(
        tensors,
        compression,
        lambda sent: ReducescatterFunction.apply(
            _names(name, len(sent)),
            resolved,
            process_set,
            prescale_factor,
            postscale_factor,
            *sent,
        ),  # fmt: skip
        lambda sent: grouped_reducescatter_async(
            sent, name, resolved, process_set, prescale_factor, postscale_factor
        ).wait(),
    )


# -- sparse ----------------------------------------------------------------------------------
class SparseHandle(FuturesHandle):
    """The handle of :func:`sparse_allreduce_async`; also callable, as Horovod's is."""

    __slots__ = ()

    def __call__(self) -> torch.Tensor:
        """Wait and return the reduced sparse tensor (same as ``synchronize(handle)``)."""
        return self.wait()  # type: ignore[no-any-return]


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: ProcessSet | None = None,
) -> SparseHandle:
    """Start an allreduce of a sparse COO tensor, as Horovod does it: allgather the entries.

    Every rank's indices and values are gathered and returned as one sparse tensor of the
    same size (duplicate indices sum when coalesced); ``op=Average`` divides the values by the
    number of ranks. ``synchronize(handle)`` or ``handle()`` returns it.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        raise ConfigurationError(
            "sparse_allreduce_async takes a sparse COO tensor (tensor.to_sparse()); use "
            "allreduce_async for dense tensors"
        )
    resolved = resolve_op(op)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ConfigurationError(
            f"sparse_allreduce_async supports op=Average or op=Sum, got {resolved.name.title()}"
        )
    t = tensor.detach()
    size = _engine.require("sparse_allreduce_async", process_set).backend.size
    label = name or "sparse_allreduce"
    vname, iname = (None, None) if name is None else (f"{name}.values", f"{name}.indices")
    indices = t._indices().transpose(0, 1).contiguous()  # allgather concatenates on dim 0
    values = t._values().contiguous()
    blocking = in_waited_ops()
    futures = [
        _ops.allgather(_TORCH, values, Call(vname, blocking, process_set)),
        _ops.allgather(_TORCH, indices, Call(iname, blocking, process_set)),
    ]

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        gathered_values, gathered_indices = results
        if resolved is ReduceOp.AVERAGE:
            gathered_values = gathered_values / size
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1),
            gathered_values,
            t.size(),
            dtype=t.dtype,
            check_invariants=False,  # built from valid tensors; the check costs a pass
        )

    return SparseHandle(futures, label, finish)


__all__ = [
    "SparseHandle",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
]
