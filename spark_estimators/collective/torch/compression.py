"""Gradient compression for the wire: Horovod's ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spark_estimators.collective import compression_base


class Compressor(compression_base.Compressor[torch.Tensor, torch.dtype]):
    """Turns a tensor into what is sent (``compress``) and back (``decompress``)."""


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class FP16Compressor(Compressor):
    """Send floating tensors as float16 (half the bytes; about 3 significant digits)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        """Cast a floating ``tensor`` to float16; the context is its dtype."""
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        """Cast ``tensor`` back to the dtype in ``ctx``."""
        return tensor.to(ctx) if ctx is not None else tensor


def compressed_apply(
    tensors: Sequence[torch.Tensor],
    compression: type[Compressor],
    differentiable: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
    plain: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
) -> list[torch.Tensor]:
    """Compress ``tensors``, run an op on them and decompress its results.

    The op is ``differentiable`` (an autograd function) when autograd records, i.e. grad is
    enabled and an input requires it, else ``plain``.
    """
    compressed = [compression.compress(t) for t in tensors]
    sent = [c for c, _ in compressed]
    record = torch.is_grad_enabled() and any(c.requires_grad for c in sent)
    outs = (differentiable if record else plain)(sent)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed, strict=True)]


class Compression:
    """Horovod's compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
