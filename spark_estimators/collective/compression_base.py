"""The framework-free part of horovod's gradient compression: the ``Compressor`` interface.

A compressor turns a tensor into what is sent (``compress(tensor) -> (sent, ctx)``) and the
received tensor back (``decompress(received, ctx) -> tensor``). :class:`Compressor` is that
interface with horovod's no-op bodies, generic in the tensor and context types; the torch and
TensorFlow adapters (:mod:`spark_estimators.collective.torch.compression`,
:mod:`spark_estimators.collective.tensorflow.compression`) subclass it for their tensors and add
their ``FP16Compressor``. This module imports no framework.
"""

from __future__ import annotations

from typing import Generic, TypeVar

TensorT = TypeVar("TensorT")
CtxT = TypeVar("CtxT")


class Compressor(Generic[TensorT, CtxT]):
    """Interface for compressing and decompressing a tensor; this base sends it as it is.

    ``TensorT`` is the framework's tensor type, ``CtxT`` what :meth:`decompress` needs to
    restore it (a dtype for ``FP16Compressor``).
    """

    @staticmethod
    def compress(tensor: TensorT) -> tuple[TensorT, CtxT | None]:
        """Return the tensor to send and the context :meth:`decompress` needs (none here)."""
        return tensor, None

    @staticmethod
    def decompress(tensor: TensorT, ctx: CtxT | None) -> TensorT:
        """Return the received tensor restored with ``ctx`` (unchanged here)."""
        return tensor


__all__ = ["Compressor"]
