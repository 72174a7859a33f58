"""Staging buffers: batches bound for a GPU are copied once into pinned host memory.

A batch copied to a GPU from ordinary (pageable) memory goes through a driver-owned pinned
buffer, and ``Tensor.to("cuda")`` waits for the copy, so the training thread stalls on every
step and cannot queue the next step's kernels while the GPU runs the current one. From pinned
(page-locked) memory the copy is a DMA that ``to(device, non_blocking=True)`` starts and returns
from. The reader therefore writes the rows of each batch into a buffer from a *staging*
allocator, in its background thread, where the rows are copied anyway:

- a block at least one batch long: the rows its batches take are copied into one buffer, and the
  batches are views of it (the one copy the data gets after decoding);
- a batch made of several blocks (wide rows, e.g. images: a decoded block is about 1 MB, less
  than a batch) is concatenated straight into its buffer (the copy it needs anyway).

``pinned_empty`` (torch's pinned host allocator, which caches its buffers and does not hand a
buffer out again while a ``non_blocking`` copy from it is in flight) is what GPU ranks get: by
default (``pin_memory=None``) whenever the blocks are CPU torch tensors and this process has
initialised CUDA (a rank that moved its model to a GPU). Any other ``(shape, dtype) -> tensor``
allocator can be given (the CPU tests use one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard, cast

import numpy as np

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

#: ``(shape, torch dtype) -> uninitialised CPU tensor``.
Allocator = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]
#: Row-wise concatenation of a batch's pieces (a column's tensors or arrays).
Join = Callable[[list[object]], object]


def cuda_in_use() -> bool:
    """Whether this process imported torch and initialised CUDA (without importing torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except (AttributeError, RuntimeError):
        return False


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in pinned host memory (torch's caching host allocator)."""
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned_on(device: int) -> Allocator:
    """:func:`pinned_empty` under CUDA device ``device`` (whatever the calling thread's device).

    The reader allocates on its own thread, whose current device is 0 unless set: a rank on GPU 1
    would otherwise open a CUDA context on GPU 0 (as DataLoader's pin thread sets the device).
    """

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        with torch.cuda.device(device):
            return torch.empty(shape, dtype=dtype, pin_memory=True)

    return empty


def staging_allocator(pin_memory: bool | None, staging: Allocator | None) -> Allocator | None:
    """The allocator batches are staged in, or None (batches stay where they were decoded).

    ``staging`` wins; else ``pin_memory=True`` pins (a CUDA device is needed), ``None`` pins
    when :func:`cuda_in_use`, ``False`` never does. Call it on the training thread: pinned
    buffers are allocated under that thread's current CUDA device (:func:`pinned_on`).
    """
    if staging is not None:
        return staging
    if pin_memory is None:
        pin_memory = cuda_in_use()
    if not pin_memory:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise ConfigurationError(
            "pin_memory=True needs a CUDA device (pinned host memory is allocated through the "
            "CUDA driver) and torch sees none; pass pin_memory=None (pin only when CUDA is in "
            "use) or False"
        )
    return pinned_on(torch.cuda.current_device())


def _is_cpu_tensor(value: object) -> TypeGuard[torch.Tensor]:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _copy_rows(parts: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Copy CPU tensors ``parts`` row-wise into ``buf``, on this thread only.

    numpy's copy runs on the calling thread without the GIL; ``torch.cat`` / ``copy_`` split a
    large copy over torch's intra-op threads, which on a loaded host (or beside a training thread
    that uses them) measured 146 ms for a 12.5 MB batch against ~6 ms for one thread.
    """
    try:
        views = [p.numpy() for p in parts]
        out = buf.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor with grad
        import torch

        torch.cat(parts, out=buf)
        return
    if len(views) == 1:
        out[...] = views[0]
    else:
        np.concatenate(views, axis=0, out=out)


def stage_block(block: dict[str, object], empty: Allocator) -> dict[str, object]:
    """``block`` with each CPU tensor copied into a buffer from ``empty`` (others kept)."""
    out = {}
    for name, value in block.items():
        if _is_cpu_tensor(value):
            buf = empty(tuple(value.shape), value.dtype)
            _copy_rows([value], buf)
            value = buf
        out[name] = value
    return out


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor (torch's default allocator)."""
    import torch

    return torch.empty(shape, dtype=dtype)


def joiner(empty: Allocator | None, join: Join) -> Join:
    """Row-wise concatenation, each CPU tensor's rows copied once into one buffer.

    The buffer comes from ``empty`` (default: torch's allocator) and is filled on the calling
    thread (:func:`_copy_rows`); anything but CPU tensors is joined by ``join``.
    """
    allocate = empty or torch_empty

    def concat(parts: list[object]) -> object:
        if not _is_cpu_tensor(parts[0]):
            return join(parts)
        tensors = cast("list[torch.Tensor]", parts)
        first = tensors[0]
        rows = sum(int(t.shape[0]) for t in tensors)
        buf = allocate((rows, *first.shape[1:]), first.dtype)
        _copy_rows(tensors, buf)
        return buf

    return concat
