"""Torch collective ops that move data: allgather, broadcast, alltoall, reducescatter, join.

Also ``broadcast_parameters`` and ``broadcast_optimizer_state`` (a model's and an optimizer's state
from one rank to all).

Part of :mod:`spark_estimators.collective.torch` (Horovod's names, arguments and semantics); the
reductions are in :mod:`.ops`. Out-of-place ``allgather``, ``broadcast``, ``alltoall`` and
``reducescatter`` are differentiable, with Horovod's gradients (its ``Horovod*`` autograd
functions; the tests in horovod's test/parallel/test_torch.py define them):

* allgather: the *average* over ranks of the incoming gradients, this rank's rows of it;
* broadcast: the average over ranks on the root rank, zeros elsewhere;
* alltoall: the incoming gradient sent back with an alltoall (the received splits as splits);
* reducescatter: the allgather of the incoming gradients, times ``size()`` for ``op=Sum`` and
  times the pre- and postscale factors (so ``op=Average`` gives the allgather alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from spark_estimators.collective.api.numpy_ops import broadcast_object
from spark_estimators.collective.backends.base import ReduceOp
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import ops as _ops
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
)
from spark_estimators.collective.torch.grouped import grouped_reducescatter, reducescatter_op
from spark_estimators.collective.torch.ops import _first, _per_tensor, allreduce_async

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

#: What the blocking ops that move data return: a tensor (alltoall with splits: and the splits).
_Received = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _differentiable(
    start: Callable[..., Handle],
    function: type[torch.autograd.Function],
    returns: object,
    what: str,
    doc: str,
) -> Callable[..., _Received]:
    """The blocking form of ``start``, through the autograd ``function`` when grad is needed.

    ``function.apply`` takes ``start``'s arguments, in its order, ``tensor`` first.
    """
    signature = inspect.signature(start)

    @waited
    def blocking(*args: object, **kwargs: object) -> _Received:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensor = bound.arguments["tensor"]
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
            return cast("_Received", function.apply(*bound.args))
        return cast("_Received", start(*bound.args).wait())

    return named(blocking, what, doc, signature.replace(return_annotation=returns))


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Start an allgather; see :func:`allgather`."""
    t = as_tensor(tensor, "allgather_async")
    future = _ops.allgather(_TORCH, t, Call(name, in_waited_ops(), process_set))
    return FuturesHandle([future], name or "allgather")


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    @waited
    def forward(
        ctx: OpContext, tensor: torch.Tensor, name: str | None, process_set: ProcessSet | None
    ) -> torch.Tensor:
        ctx.dim0, ctx.process_set = tensor.shape[0], process_set
        return allgather_async(tensor, name, process_set).wait()

    @staticmethod
    @waited
    def backward(ctx: OpContext, grad: torch.Tensor) -> Grads:
        ps = ctx.process_set
        reduced = allreduce_async(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ps).wait()
        dims = allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64), None, ps).wait()
        offset = int(dims[: _engine.require("allgather", ps).backend.rank].sum())
        return reduced.narrow(0, offset, ctx.dim0), None, None


allgather = _differentiable(
    allgather_async,
    _AllgatherFunction,
    torch.Tensor,
    "allgather",
    """Concatenate ``tensor`` from every rank on dim 0; the first dimension may differ.

    Returns
    -------
    torch.Tensor
        Shape ``(sum of every rank's dim 0, *tensor.shape[1:])``, in rank order.
    """,
)


def _broadcast_start(in_place: bool, what: str, doc: str) -> Callable[..., Handle]:
    """``broadcast_async_`` (``in_place``: returns ``tensor``) or its out-of-place form."""

    def start(
        tensor: torch.Tensor,
        root_rank: int,
        name: str | None = None,
        process_set: ProcessSet | None = None,
    ) -> Handle:
        t = as_tensor(tensor, what)
        out = t if in_place else torch.empty_like(t, memory_format=torch.contiguous_format)
        result = tensor if in_place else out
        future = _ops.broadcast(_TORCH, t, out, root_rank, Call(name, in_waited_ops(), process_set))
        return FuturesHandle([future], name or "broadcast", lambda results: result)

    return named(start, what, doc)


broadcast_async_ = _broadcast_start(
    True, "broadcast_async_", "Start an in-place broadcast from ``root_rank``."
)
broadcast_async = _broadcast_start(False, "broadcast_async", "Start a broadcast into a new tensor.")
broadcast_ = waited(
    synchronized(
        broadcast_async_,
        torch.Tensor,
        "broadcast_",
        "Overwrite ``tensor`` with ``root_rank``'s, in place, and return it.",
    )
)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    @waited
    def forward(
        ctx: OpContext,
        tensor: torch.Tensor,
        root_rank: int,
        name: str | None,
        process_set: ProcessSet | None,
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    @waited
    def backward(ctx: OpContext, grad: torch.Tensor) -> Grads:
        ps = ctx.process_set
        reduced = allreduce_async(grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ps).wait()
        if _engine.require("broadcast").backend.rank != ctx.root_rank:  # global ranks
            reduced.zero_()
        return reduced, None, None, None


broadcast = _differentiable(
    broadcast_async,
    _BroadcastFunction,
    torch.Tensor,
    "broadcast",
    "Return ``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere).",
)


def _split_list(splits: Sequence[int] | torch.Tensor | None) -> list[int] | None:
    """``splits`` (a list, or a tensor on any device) as a list of ints."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu()
    return [int(s) for s in np.asarray(splits).reshape(-1)]


def _received_splits(received: np.ndarray, splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Rows received from each rank, int32, on ``splits``' device (CPU for a list), as Horovod."""
    out = torch.from_numpy(np.asarray(received, dtype=np.int32))
    return out.to(splits.device) if isinstance(splits, torch.Tensor) else out


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start an alltoall; see :func:`alltoall`."""
    t = as_tensor(tensor, "alltoall_async")
    split_list = _split_list(splits)
    future = _ops.alltoall(_TORCH, t, split_list, Call(name, in_waited_ops(), process_set))

    def finish(
        results: list[tuple[torch.Tensor, np.ndarray]],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        if splits is None:
            return out
        return out, _received_splits(received, splits)

    return FuturesHandle([future], name or "alltoall", finish)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    @waited
    def forward(
        ctx: OpContext,
        tensor: torch.Tensor,
        splits: Sequence[int] | torch.Tensor | None,
        name: str | None,
        process_set: ProcessSet | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        split_list = _split_list(splits)
        future = _ops.alltoall(_TORCH, tensor.detach(), split_list, Call(name, True, process_set))
        out, received = future.result()
        # Horovod: the gradient goes back with the received splits (also after an even split).
        ctx.received, ctx.process_set = [int(n) for n in received], process_set
        if splits is None:
            return out
        received_splits = _received_splits(received, splits)
        ctx.mark_non_differentiable(received_splits)
        return out, received_splits

    @staticmethod
    @waited
    def backward(ctx: OpContext, grad: torch.Tensor, *unused: torch.Tensor | None) -> Grads:
        back, _ = alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set).wait()
        return back, None, None, None


alltoall = _differentiable(
    alltoall_async,
    _AlltoallFunction,
    torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    "alltoall",
    """Send ``splits[r]`` rows of ``tensor`` to rank r; receive every rank's rows for this one.

    Without ``splits`` the first dimension is split evenly (it must divide by ``size()``).

    Returns
    -------
    torch.Tensor or tuple
        The received rows in rank order; with ``splits`` also a tensor of the row counts
        received from each rank (Horovod's second return value). Differentiable.
    """,
)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = ReduceOp.AVERAGE,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter; see :func:`reducescatter`."""
    reduction = Reduction(reducescatter_op(op), prescale_factor, postscale_factor)
    compressed, ctx = compression.compress(as_tensor(tensor, "reducescatter_async"))
    future = _ops.reducescatter(
        _TORCH, compressed, reduction, Call(name, in_waited_ops(), process_set)
    )
    return FuturesHandle(
        [future], name or "reducescatter", lambda results: compression.decompress(results[0], ctx)
    )


reducescatter = _per_tensor(
    grouped_reducescatter,
    _first,
    "reducescatter",
    """Reduce ``tensor`` across ranks; rank r receives block r of the first dimension.

    Blocks are as even as possible, the first ``dim0 % size()`` ranks get one extra row.
    Differentiable (Horovod's gradient: see the module docstring).
    """,
    module=__name__,
)


def barrier(process_set: ProcessSet | None = None) -> None:
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


# -- model and optimizer state ---------------------------------------------------------------
@waited
def broadcast_parameters(
    params: dict[str, torch.Tensor] | Iterable[torch.Tensor | tuple[str, torch.Tensor]],
    root_rank: int,
    prefix: str | None = None,
    process_set: ProcessSet | None = None,
) -> None:
    """Overwrite parameters/buffers in place with ``root_rank``'s.

    Parameters
    ----------
    params
        ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
    root_rank
        The rank whose values everyone gets.
    prefix
        Accepted for Horovod compatibility (names only label errors here).
    process_set
        Broadcast among this ``ProcessSet``'s members only (``root_rank`` is a global rank).

    Notes
    -----
    Tensors are fused into one broadcast per dtype and device.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    tensors = [p.detach() for _, p in items if isinstance(p, torch.Tensor)]
    if not tensors:
        return
    futures = []
    groups = dtype_device_groups(tensors)
    for g, idx in enumerate(groups):
        futures.append(
            _ops.grouped_broadcast(
                _TORCH,
                [tensors[i] for i in idx],
                root_rank,
                Call(f"broadcast_parameters.{g}", len(groups) == 1, process_set),
            )
        )
    for future in futures:
        future.result()


def _to_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set: ProcessSet | None = None,
) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (``lr``, ...).

    The state dict travels as one pickled object (tensors moved to CPU first);
    ``load_state_dict`` puts the tensors back on each parameter's device.
    """
    me = _engine.require("broadcast_optimizer_state").backend.rank
    payload = _to_cpu(optimizer.state_dict()) if me == root_rank else None
    state = broadcast_object(
        payload, root_rank, name="broadcast_optimizer_state", process_set=process_set
    )
    if me != root_rank:
        optimizer.load_state_dict(cast("StateDict", state))
