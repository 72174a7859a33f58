"""``DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state``.

The optimizer allreduces gradients while backward runs, fused into buckets; the broadcasts start
every rank from the same model and optimizer state.

How it works (Horovod's design, with DDP-style static buckets):

* The trainable parameters are split into buckets in reverse registration order (the order in
  which backward produces their gradients), one dtype and device per bucket, each up to the
  fusion threshold in bytes (``SPARK_ESTIMATORS_FUSION_THRESHOLD`` or ``fusion_threshold=``,
  default 128 MiB; 0 gives one bucket per parameter). ``groups=`` replaces this plan.
* A post-accumulate-grad hook on every parameter counts backward passes; on the
  ``backward_passes_per_step``-th pass the parameter is ready. Buckets are launched as
  asynchronous fused allreduces *in bucket order* when all their parameters are ready, so every
  rank submits the same ops in the same order whatever order autograd runs hooks in.
  While the last bucket's gradients are lent to the steady state (below, ``zero_grad()``), its
  parameters have no hook: ``synchronize()`` launches that bucket anyway, and the calls from
  autograd into Python cost ~5 us each a step. Then the check that a gradient was not computed
  more than ``backward_passes_per_step`` times covers the other buckets (and the first steps).
* The last bucket is the exception: its gradients are the last backward produces, so nothing is
  left to overlap it with. ``step()`` runs it in the caller's thread (when the earlier buckets
  are done), which saves the hand-off to the engine thread and back; with the default 128 MiB
  threshold most models are one bucket, i.e. one op per step on the caller's thread.
* ``step()`` (or ``synchronize()``) launches what is left (a parameter without a gradient
  contributes zeros, as in Horovod), waits for every bucket, writes the averaged gradients back
  and calls the wrapped optimizer's ``step``.
* From the second step on, same-host ranks reduce the last bucket without the engine's
  negotiation round when they all can (:mod:`.steady`: one Unix-socket round of the raw bytes,
  bit for bit the engine's result; ranks not in step fall back to the engine's path).

With ``backward_passes_per_step=k`` gradients accumulate locally over k backward passes and the
sum is averaged across ranks once (Horovod's semantics, not divided by k).

``op=Adasum`` follows Horovod's delta optimizer instead: ``step()`` runs the wrapped optimizer
on the local gradients, and the change of every parameter (the delta) is combined across ranks
with Adasum (per parameter), then added to the parameters as they were before the step. No hooks,
no buckets; ``process_set=`` restricts every reduction to that set's members.

A rank outside ``process_set`` trains on its own, as in Horovod: no hooks, no reductions, and
``step()`` applies its local gradients (Adasum: its local step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import settings as _settings
from spark_estimators.collective.runtime.futures import Handle
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.collective.torch.arrays import (
    waited_ops,
)
from spark_estimators.collective.torch.compression import Compression, Compressor
from spark_estimators.collective.torch.grouped import sparse_allreduce_async
from spark_estimators.collective.torch.ops import grouped_allreduce_async_
from spark_estimators.collective.torch.optimizer_params import (
    _parameter_names,
    _trainable,
    plan_buckets,
)
from spark_estimators.collective.torch.steady import SteadyBucket
from spark_estimators.errors import CollectiveError, ConfigurationError


class _Wrapper(torch.optim.Optimizer):
    """What both wrappers (averaging and Adasum) keep of their arguments (``_se_common``)."""

    def _se_common(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        process_set: ProcessSet | None,
        local_only: bool,
    ) -> list[torch.Tensor]:
        """Keep the arguments; return the trainable parameters."""
        params = self._se_params = _trainable(self.param_groups)
        self._se_local = local_only
        self._se_names = _parameter_names(named_parameters, params)
        self._se_compression = compression
        self._se_process_set = process_set
        return params


class _DistributedOptimizer(_Wrapper):
    """Mixed in front of the user's optimizer class; see :func:`DistributedOptimizer`."""

    _se_buckets: list[list[torch.Tensor]]

    def _se_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: int | Sequence[Sequence[torch.Tensor]] | None,
        fusion_threshold: int,
        process_set: ProcessSet | None = None,
        local_only: bool = False,
        sparse_as_dense: bool = False,
    ) -> None:
        params = self._se_common(named_parameters, compression, process_set, local_only)
        self._se_sparse_as_dense = sparse_as_dense
        self._se_passes = backward_passes_per_step
        self._se_op = op
        self._se_predivide = gradient_predivide_factor
        ordered = list(reversed(params))
        explicit = None
        if isinstance(groups, int) and groups > 0:
            chunk = -(-len(ordered) // groups)
            explicit = [ordered[i : i + chunk] for i in range(0, len(ordered), chunk)]
        elif groups is not None and not isinstance(groups, int):
            explicit = [list(g) for g in groups]
        wire = {torch.float32: 2, torch.float64: 2} if compression is Compression.fp16 else None
        self._se_buckets = plan_buckets(ordered, fusion_threshold, explicit, wire)
        self._se_bucket_of = {id(p): b for b, bucket in enumerate(self._se_buckets) for p in bucket}
        self._se_delay = {id(p): backward_passes_per_step for p in params}
        self._se_ready = [0] * len(self._se_buckets)
        self._se_next = 0
        # (parameters, handle, what was sent for each) per launched bucket; sparse gradients
        # (without sparse_as_dense) travel apart, one sparse_allreduce_async each.
        self._se_inflight: list[
            tuple[list[torch.Tensor], Handle, list[tuple[torch.Tensor, torch.dtype | None]]]
        ]
        self._se_inflight = []
        self._se_sparse_inflight: list[tuple[torch.Tensor, Handle]] = []
        self._se_should_sync = True
        self._se_synchronized = False
        last = self._se_buckets[-1] if self._se_buckets else []
        self._se_steady = None
        if last and not local_only:
            names = [self._se_names[id(p)] for p in last]
            self._se_steady = SteadyBucket(
                last, self._se_bucket_name(len(self._se_buckets) - 1, last), names, op,
                1.0 / gradient_predivide_factor if op is ReduceOp.AVERAGE else 1.0,
                gradient_predivide_factor if op is ReduceOp.AVERAGE else 1.0,
                compression, process_set,
            )  # fmt: skip
        self._se_hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._se_hooked = not local_only  # until remove_hooks()
        self._se_hookless = False  # the steady bucket's hooks are off (_se_lent)
        self._se_hooks_on()

    # -- hooks and buckets -------------------------------------------------------------------
    def _se_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if self._se_delay[key] <= 0:
            raise CollectiveError(
                f"the gradient of {self._se_names[key]!r} was computed more than "
                f"backward_passes_per_step={self._se_passes} times before step(); raise "
                "backward_passes_per_step to accumulate gradients locally"
            )
        self._se_delay[key] -= 1
        if self._se_delay[key] == 0:
            b = self._se_bucket_of[key]
            self._se_ready[b] += 1
            last = len(self._se_buckets) - 1  # launched by synchronize(), see the module doc
            while self._se_next < last and self._se_ready[self._se_next] == len(
                self._se_buckets[self._se_next]
            ):
                self._se_launch(self._se_next)

    def _se_launch(self, b: int) -> None:
        bucket = self._se_buckets[b]
        dense: list[torch.Tensor] = []
        compressed: list[tuple[torch.Tensor, torch.dtype | None]] = []
        for p in bucket:
            if p.grad is None:  # not used this step here; other ranks may have a gradient
                p.grad = torch.zeros_like(p)
            grad = p.grad.detach()
            if grad.is_sparse and not self._se_sparse_as_dense:
                # Horovod: a sparse gradient is allgathered (indices and values), not reduced.
                sparse_handle = sparse_allreduce_async(
                    grad,
                    name=f"DistributedOptimizer.sparse[{self._se_names[id(p)]}]",
                    op=self._se_op,
                    process_set=self._se_process_set,
                )
                self._se_sparse_inflight.append((p, sparse_handle))
                continue
            dense.append(p)
            compressed.append(
                self._se_compression.compress(grad.to_dense() if grad.is_sparse else grad)
            )
        self._se_next = b + 1
        if not dense:
            return
        bucket = dense
        if self._se_op is ReduceOp.AVERAGE:
            pre, post = 1.0 / self._se_predivide, self._se_predivide
        else:
            pre, post = 1.0, 1.0
        handle = grouped_allreduce_async_(
            [c for c, _ in compressed],
            name=self._se_bucket_name(b, bucket),
            op=self._se_op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._se_process_set,
        )
        self._se_inflight.append((bucket, handle, compressed))

    def _se_bucket_name(self, b: int, bucket: list[torch.Tensor]) -> str:
        first = self._se_names[id(bucket[0])]
        return f"DistributedOptimizer.bucket{b}[{first}{', ...' if len(bucket) > 1 else ''}]"

    # -- public API --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step; ``step()`` calls it for you.

        Call it yourself to clip or inspect averaged gradients, then call ``step()`` inside
        ``with optimizer.skip_synchronize():``.
        """
        if self._se_local:  # not a member of the process set: local gradients as they are
            self._se_synchronized = True
            return
        last, steady = len(self._se_buckets) - 1, self._se_steady
        tried = False
        if steady is not None and self._se_next == last:
            # the steady state's usual step: only the last bucket left, nothing in flight
            tried = not (self._se_inflight or self._se_sparse_inflight)
            if tried and steady.run():
                self._se_reset()
                self._se_synchronized = True
                return
        with waited_ops():
            while self._se_next < len(self._se_buckets):
                if self._se_next == last and steady is not None and not tried and steady.run():
                    self._se_next, steady = last + 1, None  # reduced in place: nothing to wait
                    continue
                self._se_launch(self._se_next)
        inflight, self._se_inflight = self._se_inflight, []
        sparse, self._se_sparse_inflight = self._se_sparse_inflight, []
        try:
            for params, handle, compressed in inflight:
                handle.wait()
                for p, (sent, ctx) in zip(params, compressed):
                    grad = p.grad
                    assert grad is not None
                    if grad.is_sparse:  # sparse_as_dense: reduced dense, handed back sparse
                        p.grad = self._se_compression.decompress(sent, ctx).to_sparse()
                    elif sent.data_ptr() != grad.data_ptr():  # compressed: a copy was sent
                        grad.copy_(self._se_compression.decompress(sent, ctx))
            for p, handle in sparse:
                p.grad = handle.wait().coalesce()
            if steady is not None:  # the engine reduced the last bucket: the next step may not
                steady.negotiated()
        finally:
            self._se_reset()
        self._se_synchronized = True

    def _se_reset(self) -> None:
        """A new step: every parameter's backward passes counted from 0, no bucket launched."""
        self._se_delay = dict.fromkeys(self._se_delay, self._se_passes)
        self._se_ready = [0] * len(self._se_buckets)
        self._se_next = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip ``synchronize()`` (after you called it yourself)."""
        self._se_should_sync = False
        try:
            yield
        finally:
            self._se_should_sync = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._se_should_sync:
            if self._se_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are reduced twice; wrap step() in "
                    "`with optimizer.skip_synchronize():`",
                    stacklevel=2,
                )
            self.synchronize()
        self._se_synchronized = False
        return super().step(closure)

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's attribute: parameter -> the name its reduction carries."""
        return {p: self._se_names[id(p)] for p in _trainable(self.param_groups)}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Torch's ``zero_grad``; left out ``set_to_none`` zeroes the steady bucket in place.

        Then, once the last bucket took the steady state (:mod:`.steady`), its gradients are
        views of its wire buffer, zeroed here and filled in place by backward (no copy at the
        next round); the others are set to None. ``True``/``False``: torch's behaviour on all.
        """
        if self._se_inflight or self._se_sparse_inflight or any(self._se_ready):
            raise CollectiveError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); gradient allreduces are in flight"
            )
        steady = self._se_steady
        if set_to_none is None and steady is not None and steady.lend_gradients():
            lent = steady.param_ids
            if not self._se_hookless:  # synchronize() launches this bucket: no hook needed
                self._se_hookless = True
                for key in lent:
                    hook = self._se_hooks.pop(key, None)
                    if hook is not None:
                        hook.remove()
            for group in self.param_groups:  # torch's zero_grad(set_to_none=True) for the rest
                for p in group["params"]:
                    if p.grad is not None and id(p) not in lent:
                        p.grad = None
            return
        if self._se_hookless:
            self._se_hookless = False
            self._se_hooks_on()
        super().zero_grad(True if set_to_none is None else set_to_none)

    def _se_hooks_on(self) -> None:
        """A gradient hook on every parameter that has none (unless ``remove_hooks()`` ran)."""
        if self._se_hooked:
            for p in self._se_params:
                if id(p) not in self._se_hooks:
                    self._se_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._se_hook)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (e.g. before discarding this optimizer)."""
        self._se_hooked = False
        for hook in self._se_hooks.values():
            hook.remove()
        self._se_hooks = {}


class _AdasumOptimizer(_Wrapper):
    """Horovod's Adasum delta optimizer, mixed in front of the user's optimizer class."""

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the reduction happens inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for Horovod compatibility (``step()`` always reduces the deltas)."""
        yield

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._se_local:  # not a member of the process set: a local step
            return super().step(closure)
        params = self._se_params
        starts = [p.detach().clone() for p in params]
        loss = super().step(closure)
        with torch.no_grad():
            deltas = [(p.detach() - s).contiguous() for p, s in zip(params, starts)]
            sent = [self._se_compression.compress(d) for d in deltas]
            first = self._se_names[id(params[0])] if params else ""
            with waited_ops():
                grouped_allreduce_async_(
                    [c for c, _ in sent],
                    name=f"DistributedOptimizer.adasum[{first}, ...]",
                    op=ReduceOp.ADASUM,
                    process_set=self._se_process_set,
                ).wait()
            for p, start, (c, ctx) in zip(params, starts, sent):
                p.copy_(start + self._se_compression.decompress(c, ctx))
        return loss


_CLASSES: dict[type | tuple[type, str], type] = {}
# Instance attributes that must not be copied from the wrapped optimizer: an LR scheduler
# created on it replaces ``step`` per instance, which would bypass synchronize().
_NOT_COPIED = ("step", "zero_grad", "_opt_called")


def DistributedOptimizer(  # noqa: N802 (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = None,
    fusion_threshold: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Parameters
    ----------
    optimizer
        Any ``torch.optim.Optimizer``; the result is an instance of a subclass of its class
        sharing its state and ``param_groups``. Use the returned object from now on.
    named_parameters
        ``model.named_parameters()``: names label errors (mismatched models across ranks).
    compression
        ``Compression.none`` or ``Compression.fp16`` (gradients sent as float16).
    backward_passes_per_step
        Backward passes accumulated locally before the allreduce and ``step()``.
    op
        ``Average`` (default), ``Sum`` or ``Adasum`` (Horovod's delta optimizer: see the
        module docstring; a power-of-two number of ranks).
    gradient_predivide_factor
        With ``Average``: divide by this before the sum and by ``size()/factor`` after.
    num_groups, groups
        Explicit fusion groups: a number of equal groups, or lists of parameters (each one
        fused allreduce). Replaces the threshold-based buckets.
    sparse_as_dense
        Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as dense tensors and
        handed back sparse; without it (default) each is allgathered with
        :func:`~spark_estimators.collective.torch.sparse_allreduce_async`, as in Horovod.
    process_set
        Average the gradients among this ``ProcessSet``'s members only (default: every rank).
        On a rank outside the set, ``step()`` applies the local gradients (Horovod's
        behaviour): that rank trains on its own.
    fusion_threshold
        Bytes per bucket (default ``SPARK_ESTIMATORS_FUSION_THRESHOLD`` or 128 MiB; 0 = none).

    Returns
    -------
    torch.optim.Optimizer
        The distributed optimizer; also has ``synchronize()`` and ``skip_synchronize()``.

    Examples
    --------
    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ... # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer | _AdasumOptimizer):
        raise ConfigurationError("the optimizer is already a DistributedOptimizer")
    resolved = resolve_op(op, adasum=True)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ConfigurationError(
            f"DistributedOptimizer op must be Average, Sum or Adasum, got {op!r}"
        )
    if gradient_predivide_factor != 1.0 and resolved is not ReduceOp.AVERAGE:
        raise ConfigurationError("gradient_predivide_factor needs op=Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigurationError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )
    if compression not in (Compression.none, Compression.fp16) and not (
        isinstance(compression, type) and issubclass(compression, Compressor)
    ):
        raise ConfigurationError("compression must be Compression.none or Compression.fp16")
    if num_groups and groups is None:
        groups = num_groups
    local_only = False
    if process_set is not None:
        registered = getattr(process_set, "process_set_id", None) is not None
        if registered and hasattr(process_set, "included") and process_set.included() is False:
            local_only = True  # Horovod: a non-member trains locally
        else:
            _engine.require("DistributedOptimizer", process_set)  # a registered ProcessSet
    base = type(optimizer)
    if resolved is ReduceOp.ADASUM:
        if gradient_predivide_factor != 1.0:
            raise ConfigurationError("gradient_predivide_factor needs op=Average, not Adasum")
        adasum_cls = _CLASSES.get((base, "adasum"))
        if adasum_cls is None:
            adasum_cls = type(
                base.__name__, (_AdasumOptimizer, base), {"__module__": base.__module__}
            )
            _CLASSES[(base, "adasum")] = adasum_cls
        delta: _AdasumOptimizer = object.__new__(adasum_cls)
        delta.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _NOT_COPIED})
        delta._se_common(named_parameters, compression, process_set, local_only)
        return delta
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
        _CLASSES[base] = cls
    wrapped: _DistributedOptimizer = object.__new__(cls)
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _NOT_COPIED})
    wrapped._se_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        resolved,
        float(gradient_predivide_factor),
        groups,
        _settings.fusion_threshold(fusion_threshold),
        process_set,
        local_only,
        bool(sparse_as_dense),
    )
    return wrapped
