"""Gradient compression for TensorFlow tensors (``horovod.tensorflow.Compression``).

Horovod's TensorFlow interface: ``compress(tensor) -> (compressed, ctx)`` and
``decompress(compressed, ctx) -> tensor``, both on tensors (they work eagerly and inside
``tf.function``). ``Compression.fp16`` sends floating tensors as float16 and casts them back.
"""

from __future__ import annotations

import tensorflow as tf

from spark_estimators.collective import compression_base


class Compressor(compression_base.Compressor[tf.Tensor, tf.DType]):
    """Interface for compressing and decompressing a given tensor (the base sends it as it is)."""


class NoneCompressor(Compressor):
    """Default no-op compression."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and are cast back to their dtype."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, tf.DType | None]:
        """Cast a floating tensor to float16; the context is the original dtype."""
        compressed = tensor
        if tensor.dtype.is_floating:
            compressed = tf.cast(tensor, dtype=tf.float16)
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: tf.DType | None) -> tf.Tensor:
        """Cast back to the original floating dtype."""
        if ctx is not None and ctx.is_floating:
            return tf.cast(tensor, dtype=ctx)
        return tensor


class Compression:
    """``Compression.none`` (default) / ``Compression.fp16``, as in ``horovod.tensorflow``."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
