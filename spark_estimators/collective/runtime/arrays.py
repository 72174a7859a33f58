"""The array operations the collective ops need from a framework: :class:`ArrayOps`.

:class:`NumpyOps` implements them for numpy arrays; ``TorchOps`` in
:mod:`spark_estimators.collective.torch.arrays` for torch tensors. What differs between the two is
packing a fusion buffer, scaling in place and cloning; the ops in :mod:`.ops` are written once
against this protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from spark_estimators.collective.backends.base import Buffer


class ArrayOps(Protocol):
    """The array operations the op implementations need from a framework."""

    def dtype(self, x: Buffer) -> str:
        """The dtype name (``"float32"``)."""

    def device(self, x: Buffer) -> str:
        """The device type (``"cpu"``, ``"cuda"``)."""

    def shape(self, x: Buffer) -> tuple[int, ...]:
        """The shape as a tuple of ints."""

    def is_contiguous(self, x: Buffer) -> bool:
        """True when the buffer can be reduced in place."""

    def static_key(self, x: Buffer) -> Hashable:
        """A cheap key equal for buffers of the same dtype, device and shape."""

    def flat_view(self, x: Buffer) -> Buffer:
        """A 1-D view of the same memory."""

    def clone(self, x: Buffer) -> Buffer:
        """A contiguous copy."""

    def copy_(self, dst: Buffer, src: Buffer) -> None:
        """Copy ``src`` into ``dst`` (same number of elements)."""

    def scale_(self, x: Buffer, factor: float) -> None:
        """Multiply ``x`` by ``factor`` in place."""

    def pack(self, xs: Sequence[Buffer]) -> Buffer:
        """Copy ``xs`` into one flat fusion buffer and return it."""

    def pack_into(self, xs: Sequence[Buffer], flat: Buffer) -> None:
        """Copy ``xs`` one after the other into the flat buffer ``flat`` (their total size)."""

    def unpack(self, flat: Buffer, outs: Sequence[Buffer]) -> None:
        """Copy a packed buffer back into ``outs``."""

    def scratch(self, like: Buffer, numel: int) -> Buffer:
        """A flat buffer of ``numel`` elements like ``like``, reused by the calling thread."""

    def adopt(self, result: Buffer, like: Buffer) -> Buffer:
        """The backend's ``result`` as a buffer of this framework, like ``like``."""


#: Alignment TensorFlow requires for zero-copy DLPack import on the CPU.
ALIGNMENT = 64


def aligned_empty(n: int, dtype: DTypeLike) -> np.ndarray:
    """A 1-d numpy array of ``n`` elements whose data starts on a 64-byte boundary."""
    dt = np.dtype(dtype)
    raw = np.empty(n * dt.itemsize + ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset : offset + n * dt.itemsize].view(dt)


def numel_of(shape: tuple[int, ...]) -> int:
    """The number of elements of an array of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def scale_array(x: np.ndarray, factor: float) -> None:
    """Multiply ``x`` by ``factor`` in place.

    Integer arrays are scaled in float64 and truncated toward zero, as Horovod scales integer
    tensors (``op=Average``, ``prescale_factor``, ``postscale_factor``); float16 in float32.
    """
    if x.dtype.kind in "iu":
        x[...] = (x * factor).astype(x.dtype)
    elif x.dtype == np.float16:  # in float32, rounded once (as torch and Horovod on CPU)
        x[...] = (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    else:
        np.multiply(x, x.dtype.type(factor), out=x)


class NumpyOps:
    """:class:`ArrayOps` for numpy arrays (used by the core API and the Keras adapter)."""

    def __init__(self) -> None:
        self._local = _ThreadBuffers()  # pack(), scratch(): each thread's own (see TorchOps)

    def dtype(self, x: np.ndarray) -> str:
        """The dtype name (``"float32"``)."""
        return x.dtype.name

    def device(self, x: np.ndarray) -> str:
        """Always ``"cpu"``."""
        return "cpu"

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        """The shape as a tuple of ints."""
        return tuple(int(d) for d in x.shape)

    def static_key(self, x: np.ndarray) -> Hashable:
        """The dtype and shape."""
        return (x.dtype, x.shape)

    def is_contiguous(self, x: np.ndarray) -> bool:
        """True for a writable C-contiguous array."""
        return bool(x.flags.c_contiguous and x.flags.writeable)

    def flat_view(self, x: np.ndarray) -> np.ndarray:
        """A 1-D view of the same memory."""
        return x.reshape(-1)

    def clone(self, x: np.ndarray) -> np.ndarray:
        """A C-contiguous copy."""
        return np.array(x, copy=True, order="C")

    def copy_(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst`` (same number of elements)."""
        np.copyto(dst, np.asarray(src).reshape(dst.shape))

    def scale_(self, x: np.ndarray, factor: float) -> None:
        """Multiply ``x`` by ``factor`` in place (integers: see :func:`scale_array`)."""
        scale_array(x, factor)

    def pack(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        """Copy ``xs`` into this thread's fusion buffer of their dtype; return its used part."""
        flat = _head(self._local.fusion, xs[0].dtype, sum(int(x.size) for x in xs))
        self.pack_into(xs, flat)
        return flat

    def scratch(self, like: np.ndarray, numel: int) -> np.ndarray:
        """The first ``numel`` elements of this thread's reused buffer of ``like``'s dtype."""
        return _head(self._local.buffers, like.dtype, numel)

    def pack_into(self, xs: Sequence[np.ndarray], flat: np.ndarray) -> None:
        """Copy ``xs`` one after the other into ``flat`` (their total size)."""
        offset = 0
        for x in xs:
            flat[offset : offset + x.size] = x.reshape(-1)
            offset += x.size

    def unpack(self, flat: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Copy a packed buffer back into ``outs``."""
        offset = 0
        for out in outs:
            out[...] = flat[offset : offset + out.size].reshape(out.shape)
            offset += out.size

    def adopt(self, result: Buffer, like: np.ndarray) -> np.ndarray:
        """The backend's ``result`` as a numpy array."""
        return np.asarray(result)


class _ThreadBuffers(threading.local):
    """A thread's reused buffers: :meth:`NumpyOps.pack`'s and :meth:`NumpyOps.scratch`'s."""

    def __init__(self) -> None:
        self.fusion: dict[str, np.ndarray] = {}
        self.buffers: dict[str, np.ndarray] = {}


def _head(buffers: dict[str, np.ndarray], dtype: np.dtype, numel: int) -> np.ndarray:
    """The first ``numel`` elements of ``buffers``' buffer of ``dtype`` (grown when too small)."""
    buf = buffers.get(dtype.name)
    if buf is None or buf.size < numel:
        buf = buffers[dtype.name] = np.empty(numel, dtype=dtype)
    return buf[:numel]


def write_result(
    ops: ArrayOps, result: Buffer, inputs: Sequence[Buffer], outputs: Sequence[Buffer]
) -> Sequence[Buffer]:
    """Copy a backend's flat ``result`` for ``inputs`` into ``outputs`` and return ``outputs``."""
    reduced = ops.adopt(result, inputs[0])
    if len(outputs) == 1:
        ops.copy_(outputs[0], reduced)
    else:
        ops.unpack(reduced, outputs)
    return outputs
