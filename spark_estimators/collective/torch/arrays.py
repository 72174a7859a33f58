"""``TorchOps``: the :class:`~spark_estimators.collective.runtime.ops.ArrayOps` of torch tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class TorchOps:
    """:class:`~spark_estimators.collective.runtime.ops.ArrayOps` for torch tensors.

    The fusion buffers are touched only by the engine thread.
    """

    def __init__(self) -> None:
        self._fusion: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def dtype(self, x: torch.Tensor) -> str:
        return str(x.dtype).removeprefix("torch.")

    def device(self, x: torch.Tensor) -> str:
        return x.device.type

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(int(d) for d in x.shape)

    def is_contiguous(self, x: torch.Tensor) -> bool:
        return bool(x.is_contiguous())

    def flat_view(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1)

    def clone(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone(memory_format=torch.contiguous_format)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.reshape(dst.shape))

    def scale_(self, x: torch.Tensor, factor: float) -> None:
        x.mul_(factor)

    def pack(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        total = sum(int(x.numel()) for x in xs)
        key = (xs[0].dtype, xs[0].device)
        buf = self._fusion.get(key)
        if buf is None or buf.numel() < total:
            buf = torch.empty(total, dtype=key[0], device=key[1])
            self._fusion[key] = buf
        flat = buf[:total]
        torch.cat([x.reshape(-1) for x in xs], out=flat)
        return flat

    def unpack(self, flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        offset = 0
        for out in outs:
            n = out.numel()
            out.copy_(flat[offset : offset + n].view(out.shape))
            offset += n

    def adopt(self, result: Any, like: torch.Tensor) -> torch.Tensor:
        if isinstance(result, torch.Tensor):
            return result
        return torch.from_numpy(np.ascontiguousarray(result)).to(like.device)


_TORCH = TorchOps()
