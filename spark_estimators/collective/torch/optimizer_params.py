"""The parameters a ``DistributedOptimizer`` reduces, and the names its reductions carry."""

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
