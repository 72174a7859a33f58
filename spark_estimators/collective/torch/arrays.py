"""Torch tensors for the collective runtime.

``TorchOps`` (the :class:`~spark_estimators.collective.runtime.arrays.ArrayOps` of torch
tensors) and the helpers shared by the torch ops and ``DistributedOptimizer``: argument
checks, grouping by dtype and device, and :func:`waited_ops`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeAlias, TypeVar

import numpy as np
import torch
from torch.autograd.function import FunctionCtx

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    from spark_estimators.collective.backends.base import ReduceOp
    from spark_estimators.collective.runtime.process_sets import ProcessSet


class OpContext(FunctionCtx):
    """The ``ctx`` of this package's autograd functions: what forward keeps for backward.

    For readers and the type checker only: torch makes the real ``ctx``.
    """

    op: ReduceOp
    pre: float
    post: float
    process_set: ProcessSet | None
    dim0: int
    dims: list[int]
    root_rank: int
    received: list[int]
    total: float
    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[torch.Tensor, ...]


#: What a backward returns: one gradient per forward input (None for the non-tensors).
Grads: TypeAlias = tuple[torch.Tensor | None, ...]


def as_tensor(x: object, op: str) -> torch.Tensor:
    """``x`` detached from autograd; raise naming ``op`` when it is not a tensor."""
    if not isinstance(x, torch.Tensor):
        raise ConfigurationError(f"{op} takes a torch.Tensor, got {type(x).__name__}")
    return x.detach()


def dtype_device_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


# Set while a blocking function runs: the ops it starts are waited for at once, so the engine
# may run them in this thread when it is idle (see Engine.submit).
class _Waited(threading.local):
    blocking = False  # each thread starts outside waited_ops


_local = _Waited()
_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def waited_ops() -> Iterator[None]:
    """Ops started inside are waited for right away: run them in this thread when it can.

    The engine then skips the hand-off to its thread (two thread wake-ups per op, which cost
    more than a small op itself on a busy machine).
    """
    previous = _local.blocking
    _local.blocking = True
    try:
        yield
    finally:
        _local.blocking = previous


def waited(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate ``fn`` so that it runs inside :func:`waited_ops`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with waited_ops():
            return fn(*args, **kwargs)

    return wrapper


def in_waited_ops() -> bool:
    """True inside :func:`waited_ops`: ops started now are submitted as blocking."""
    return _local.blocking


#: ``torch._foreach_copy_`` (private: one call copies a list of tensors, ~4x faster than a
#: ``copy_`` per tensor for 100 small ones); None in a torch without it: a ``copy_`` each.
_FOREACH_COPY: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], object] | None = getattr(
    torch, "_foreach_copy_", None
)
#: Most output layouts whose views of a fusion buffer are kept per buffer (then all dropped).
_MOST_LAYOUTS = 64
_Layout: TypeAlias = tuple[torch.Size, ...]


def copy_all(outs: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``out.copy_(src)`` for each pair, in one call where torch has ``_foreach_copy_``."""
    if _FOREACH_COPY is not None:
        _FOREACH_COPY(outs, srcs)
        return
    for out, src in zip(outs, srcs, strict=True):
        out.copy_(src)


class TorchOps:
    """:class:`~spark_estimators.collective.runtime.arrays.ArrayOps` for torch tensors.

    The buffers of :meth:`pack` and of :meth:`scratch` are the calling thread's own: the engines
    of several process sets run in their own threads at once, and one shared fusion buffer let
    two fused batches of one dtype overwrite each other's data. The views of either buffer in the
    shapes of a batch's outputs are kept per buffer and layout: a repeated batch unpacks without
    splitting the buffer again (``split`` and the per-view reshapes cost more than the copies of 100
    small tensors).
    """

    def __init__(self) -> None:
        self._local = _Scratch()

    def dtype(self, x: torch.Tensor) -> str:
        """The dtype name without ``torch.`` (``"float32"``)."""
        return str(x.dtype).removeprefix("torch.")

    def device(self, x: torch.Tensor) -> str:
        """The device type (``"cpu"``, ``"cuda"``)."""
        return x.device.type

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape as a tuple of ints."""
        return tuple(int(d) for d in x.shape)

    def static_key(self, x: torch.Tensor) -> Hashable:
        """The dtype, device and shape (no device for a CPU tensor: a new object per read)."""
        if x.is_cpu:
            return (x.dtype, x.shape)
        return (x.dtype, x.device, x.shape)

    def is_contiguous(self, x: torch.Tensor) -> bool:
        """True for a contiguous tensor."""
        return bool(x.is_contiguous())

    def flat_view(self, x: torch.Tensor) -> torch.Tensor:
        """A 1-D view of the same memory."""
        return x.view(-1)

    def clone(self, x: torch.Tensor) -> torch.Tensor:
        """A contiguous copy."""
        return x.detach().clone(memory_format=torch.contiguous_format)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (same number of elements)."""
        dst.copy_(src.reshape(dst.shape))

    def scale_(self, x: torch.Tensor, factor: float) -> None:
        """Multiply ``x`` by ``factor`` in place (integers in float64, truncated, as Horovod)."""
        if x.is_cuda and x.dtype == torch.float16:
            # Horovod's GPU kernels take the factor in the tensor's dtype (its test_torch.py
            # scaling tests check it); on CPU torch computes in float32, as Horovod does there.
            x.mul_(torch.tensor(factor, dtype=x.dtype, device=x.device))
        elif x.is_floating_point() or x.is_complex():
            x.mul_(factor)
        else:
            x.copy_(x.to(torch.float64).mul_(factor))  # the cast back truncates toward zero

    def pack(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy ``xs`` into this thread's fusion buffer of their dtype and device (that part)."""
        local = self._local
        flat = _head(local.fusion, local.kept, xs[0], sum(int(x.numel()) for x in xs))
        self.pack_into(xs, flat)
        return flat

    def scratch(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of this thread's reused buffer like ``like``.

        Of ``like``'s dtype and device; another thread (another process set's engine) never
        shares it.
        """
        local = self._local
        return _head(local.buffers, local.kept, like, numel)

    def pack_into(self, xs: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy ``xs`` one after the other into the 1-D tensor ``flat`` (their total size)."""
        # 1-D tensors go in as they are (a reshape per tensor costs more than the copy).
        torch.cat([x if x.dim() == 1 else x.reshape(-1) for x in xs], out=flat)

    def unpack(self, flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Copy a packed buffer (at least as long as ``outs`` together) back into ``outs``."""
        if len(outs) == 1:
            out = outs[0]
            total = out.numel()
            out.copy_((flat if flat.numel() == total else flat[:total]).view(out.shape))
            return
        copy_all(outs, self._views_of(flat, outs))

    def _views_of(self, flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``flat`` in the shapes of ``outs``, kept when ``flat`` is a reused buffer."""
        kept = self._local.kept.get((flat.data_ptr(), flat.dtype))
        if kept is None:
            return _views(flat, outs)
        layout = tuple([out.shape for out in outs])
        views = kept.get(layout)
        if views is None:
            if len(kept) >= _MOST_LAYOUTS:
                kept.clear()
            views = kept[layout] = _views(flat, outs)
        elif flat.numel() < views[-1].storage_offset() - flat.storage_offset() + views[-1].numel():
            _views(flat, outs)  # raises as without the kept views (flat too short)
        return views

    def adopt(self, result: np.ndarray | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The backend's ``result`` as a tensor on ``like``'s device."""
        if isinstance(result, torch.Tensor):
            return result
        return torch.from_numpy(np.ascontiguousarray(result)).to(like.device)


class _Scratch(threading.local):
    """A thread's reused buffers (:meth:`TorchOps.pack`, :meth:`TorchOps.scratch`), their views."""

    def __init__(self) -> None:
        self.fusion: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.kept: dict[tuple[int, torch.dtype], dict[_Layout, list[torch.Tensor]]] = {}


def _head(
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor],
    kept: dict[tuple[int, torch.dtype], dict[_Layout, list[torch.Tensor]]],
    like: torch.Tensor,
    numel: int,
) -> torch.Tensor:
    """The first ``numel`` elements of ``buffers``' buffer like ``like`` (grown when too small).

    A new buffer gets an empty entry in ``kept`` (its views by layout); the old one's goes.
    """
    key = (like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            kept.pop((buf.data_ptr(), buf.dtype), None)
        buf = buffers[key] = torch.empty(numel, dtype=key[0], device=key[1])
        if numel > 0:
            kept[buf.data_ptr(), buf.dtype] = {}
    return buf[:numel]


def _views(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the head of ``flat`` in the shapes of ``outs``, one after the other."""
    sizes = [out.numel() for out in outs]
    total = sum(sizes)
    if flat.numel() != total:
        flat = flat[:total]
    # One split makes every view at once (slicing them one by one costs several times more).
    return [part if out.dim() == 1 else part.view(out.shape)
            for out, part in zip(outs, flat.split(sizes), strict=True)]  # fmt: skip


_TORCH = TorchOps()
