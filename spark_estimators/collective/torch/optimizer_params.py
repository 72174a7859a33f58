"""The parameters a ``DistributedOptimizer`` reduces, their buckets, the names reductions carry."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from spark_estimators.errors import ConfigurationError


def _trainable(param_groups: Sequence[Mapping[str, Iterable[torch.Tensor]]]) -> list[torch.Tensor]:
    """The parameters that need gradients, each once, in the optimizer's order."""
    params: list[torch.Tensor] = []
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad and all(p is not q for q in params):
                params.append(p)
    return params


def _parameter_names(
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None, params: Sequence[torch.Tensor]
) -> dict[int, str]:
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ConfigurationError(
            "named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()"
        )
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f"named_parameters has duplicate names: {duplicates[:5]}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ConfigurationError(
            f"named_parameters does not name {len(missing)} of the optimizer's parameters "
            "(pass model.named_parameters() of the model whose parameters the optimizer holds)"
        )
    return {id(p): by_id[id(p)] for p in params}


def plan_buckets(
    params: Sequence[torch.Tensor],
    threshold: int,
    groups: Sequence[Sequence[torch.Tensor]] | None = None,
    bytes_per_element: dict[torch.dtype, int] | None = None,
) -> list[list[torch.Tensor]]:
    """Split ``params`` (already in launch order) into buckets.

    Parameters
    ----------
    params
        Trainable parameters, in the order their gradients are expected.
    threshold
        Most bytes per bucket; 0 puts every parameter in its own bucket. A parameter larger
        than the threshold gets a bucket of its own.
    groups
        Explicit buckets; parameters in no group get one bucket each.
    bytes_per_element
        Element size on the wire per dtype (fp16 compression halves float32).
    """
    if groups is not None:
        seen = {id(p) for g in groups for p in g}
        wanted = {id(p) for p in params}
        explicit = [[p for p in g if id(p) in wanted] for g in groups]
        return [b for b in explicit if b] + [[p] for p in params if id(p) not in seen]
    sizes = bytes_per_element or {}
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for p in params:
        nbytes = p.numel() * sizes.get(p.dtype, p.element_size())
        same_kind = bool(current) and (current[0].dtype, current[0].device) == (p.dtype, p.device)
        if current and (not same_kind or threshold == 0 or current_bytes + nbytes > threshold):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets
