"""``SyncBatchNorm``: batch normalisation with statistics over the whole global batch.

Works on CPU and GPU through the collective layer (``torch.nn.SyncBatchNorm`` needs CUDA). In
training each forward allreduces ``[count * mean, count * (var + mean**2), count]`` per channel
and each backward allreduces the two per-channel gradient sums, so a job of N ranks x B rows
normalises exactly like one process with N*B rows. Weight and bias gradients stay local sums;
``DistributedOptimizer`` averages them like any other gradient.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from spark_estimators.collective.backends.base import ReduceOp
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.torch.arrays import Grads, OpContext
from spark_estimators.collective.torch.ops import allreduce_


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (C, N * prod(*))."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: OpContext,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        flat = _per_channel(x).to(torch.float64)
        count = flat.shape[1]
        mean = flat.mean(dim=1)
        sq = (flat * flat).mean(dim=1)
        stats = torch.cat([mean * count, sq * count, flat.new_tensor([float(count)])])
        allreduce_(stats, op=ReduceOp.SUM, name="SyncBatchNorm.stats")
        channels = x.shape[1]
        total = float(stats[-1])
        g_mean = stats[:channels] / total
        g_var = (stats[channels : 2 * channels] / total - g_mean * g_mean).clamp_min(0)
        if running_mean is not None and running_var is not None:
            unbiased = g_var * (total / max(total - 1.0, 1.0))
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(g_var + eps).to(x.dtype)
        xhat = (x - _bcast(g_mean.to(x.dtype), x)) * _bcast(invstd, x)
        ctx.save_for_backward(xhat, invstd, weight)  # type: ignore[arg-type]  # None is kept
        ctx.total = total
        out = xhat
        if weight is not None:
            out = out * _bcast(weight, x)
        if bias is not None:
            out = out + _bcast(bias, x)
        return out

    @staticmethod
    def backward(ctx: OpContext, dy: torch.Tensor) -> Grads:
        xhat, invstd, weight = ctx.saved_tensors
        sum_dy = _per_channel(dy).sum(dim=1)
        sum_dy_xhat = _per_channel(dy * xhat).sum(dim=1)
        grad_weight = sum_dy_xhat.clone() if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if ctx.needs_input_grad[2] else None
        sums = torch.cat([sum_dy, sum_dy_xhat]).contiguous()
        allreduce_(sums, op=ReduceOp.SUM, name="SyncBatchNorm.grad")
        channels = dy.shape[1]
        mean_dy = sums[:channels] / ctx.total
        mean_dy_xhat = sums[channels:] / ctx.total
        scale = invstd if weight is None else invstd * weight
        dx = (dy - _bcast(mean_dy, dy) - xhat * _bcast(mean_dy_xhat, dy)) * _bcast(scale, dy)
        return dx, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalises over every rank's batch.

    Parameters are those of ``torch.nn.BatchNorm*d``. Outside training, or with one rank, it
    behaves exactly like a plain batch norm.

    Examples
    --------
    >>> bn = hvd.SyncBatchNorm(64)  # doctest: +SKIP
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise with the batch statistics of every rank (training) or the running ones."""
        self._check_input_dim(input)
        engine = _engine.current()
        distributed = engine is not None and engine.backend.size > 1
        if not (self.training and distributed):
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(  # type: ignore[no-any-return]
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum
        )


__all__ = ["SyncBatchNorm"]
