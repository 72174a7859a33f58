"""Normalisation running statistics: the per-rank state that data-parallel training lets differ.

Every rank updates BatchNorm's ``running_mean`` and ``running_var`` (and InstanceNorm's, when it
tracks them) from its own batches, so at the end of a fit the ranks hold different statistics
while their parameters are equal. The estimators return rank 0's, as horovod does; with
``average_running_stats=True`` they call :func:`average_running_stats` when training ends, so the
returned model's statistics are the mean over the ranks (each rank's running estimate weighted
equally, as timm's ``distribute_bn(reduce=True)`` does). ``num_batches_tracked`` is the same
on every rank (every rank runs the same steps) and is left alone. Users who want the statistics
of the whole global batch at every step use ``spark_estimators.collective.torch.SyncBatchNorm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def running_stat_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point running statistics of every normalisation layer in ``module``.

    In ``module.named_modules()`` order (the same on every rank): each ``_NormBase`` layer
    (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``InstanceNorm*`` with
    ``track_running_stats=True``, the lazy variants) contributes ``running_mean`` and
    ``running_var`` when it has them.
    """
    from torch.nn.modules.batchnorm import _NormBase

    buffers = []
    for _, layer in module.named_modules():
        if not isinstance(layer, _NormBase) or not layer.track_running_stats:
            continue
        for name in ("running_mean", "running_var"):
            buf = getattr(layer, name, None)
            if buf is not None and buf.is_floating_point():
                buffers.append(buf)
    return buffers


def average_running_stats(
    module: torch.nn.Module, allreduce_sum_: Callable[[torch.Tensor], object], size: int
) -> int:
    """Replace every running statistic of ``module`` by its mean over the ranks, in place.

    ``allreduce_sum_`` sums one flat tensor over the ranks in place (every rank calls this
    function, with the same module structure). All statistics travel in one float64 allreduce.
    Returns the number of tensors averaged.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    >>> average_running_stats(m, lambda flat: flat, size=1)  # one rank: unchanged
    2
    """
    import torch

    buffers = running_stat_buffers(module)
    if size <= 1 or not buffers:
        return len(buffers)
    with torch.no_grad():
        # float64 holds every float dtype exactly: one allreduce for all the statistics.
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
        allreduce_sum_(flat)
        flat /= size
        offset = 0
        for buf in buffers:
            n = buf.numel()
            buf.copy_(flat[offset : offset + n].reshape(buf.shape))
            offset += n
    return len(buffers)
