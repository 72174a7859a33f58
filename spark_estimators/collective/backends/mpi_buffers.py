"""Buffers for the MPI backend: numpy views of arrays and CPU tensors, and bfloat16 reductions.

MPI has no bfloat16: those tensors travel as ``uint16`` and reduce through an MPI user op that
computes in float32 (:func:`bf16_reduction`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from spark_estimators.collective.backends.base import Buffer, ReduceOp
from spark_estimators.errors import ConfigurationError


def is_bf16(buf: Buffer) -> bool:
    """True for a torch bfloat16 tensor."""
    return not isinstance(buf, np.ndarray) and str(buf.dtype) == "torch.bfloat16"


def numpy_view(buf: Buffer) -> np.ndarray:
    """A numpy array sharing ``buf``'s memory (bfloat16 tensors as uint16)."""
    if isinstance(buf, np.ndarray):
        return buf
    if buf.device.type != "cpu":
        raise ConfigurationError(
            f"backend='mpi' works on CPU buffers, got a tensor on {buf.device}; move it to the "
            "CPU first or use backend='nccl' for GPU tensors"
        )
    tensor = buf.detach()
    if is_bf16(tensor):
        import torch

        tensor = tensor.view(torch.int16)
    return np.asarray(tensor.numpy())


def new_like(buf: Buffer, shape: tuple[int, ...]) -> tuple[Buffer, np.ndarray]:
    """A new buffer of ``buf``'s kind and dtype, and its numpy view."""
    if isinstance(buf, np.ndarray):
        out = np.empty(shape, dtype=buf.dtype)
        return out, out
    tensor = buf.new_empty(shape)
    return tensor, numpy_view(tensor)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values, rounded to nearest even as torch does; NaN stays NaN."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | np.uint32(0x40)
    return rounded.astype(np.uint16)


_NUMPY_REDUCERS: dict[ReduceOp, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def bf16_reduction(op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """The function of an MPI user op that reduces bfloat16 buffers with ``op`` in float32."""
    reduce = _NUMPY_REDUCERS[op]

    def function(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        incoming = np.frombuffer(inbuf, dtype=np.uint16)
        inout = np.frombuffer(inoutbuf, dtype=np.uint16)
        inout[...] = f32_to_bf16(reduce(bf16_to_f32(incoming), bf16_to_f32(inout)))

    return function
