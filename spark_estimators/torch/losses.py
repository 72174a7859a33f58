"""Horovod's loss and metric rules for ``TorchEstimator`` (rank side; torch imported lazily).

``metric_plan`` names each recorded metric; ``compute_loss`` / :class:`LossFn` combine the losses
of several outputs with ``loss_weights`` and sample weights as Horovod did; ``match_output``
reshapes a label to its output when both hold as many values.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    #: A loss: ``(output, label) -> tensor`` (a torch loss module or a function).
    Loss: TypeAlias = Callable[..., torch.Tensor]
    #: A metric: ``(output, label) -> value``.
    Metric: TypeAlias = Callable[..., "torch.Tensor | float"]
    #: One ``metrics`` entry: a metric for every output, or a group with one per output.
    MetricEntry: TypeAlias = Metric | list[Metric] | tuple[Metric, ...]
    #: A model's output(s).
    Outputs: TypeAlias = "torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]"


def metric_name(metric: object) -> str:
    """A metric's or loss's name: its ``__name__``, else its class name."""
    return str(getattr(metric, "__name__", None) or type(metric).__name__)


def metric_plan(
    metrics: Sequence[MetricEntry], label_cols: list[str]
) -> list[tuple[str, Metric, int]]:
    """``(name, fn, output index)`` for each metric value recorded per epoch.

    As in Horovod, an entry may be a group (a list): one function for every output, or one per
    output. A plain function is one group of one. With one label a metric is named by its
    function (``mae``); with several, by function and label column (``mae_y1``, ``mae_y2``).
    """
    several = len(label_cols) > 1
    plan: list[tuple[str, Metric, int]] = []
    for entry in metrics:
        group = list(entry) if isinstance(entry, list | tuple) else [entry]
        fns = group * len(label_cols) if len(group) == 1 else group
        for i, (fn, col) in enumerate(zip(fns, label_cols, strict=True)):
            plan.append((f"{metric_name(fn)}_{col}" if several else metric_name(fn), fn, i))
    return plan


def compute_loss(
    losses: Sequence[Loss],
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    loss_weights: list[float] | None,
    sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Horovod's loss: ``sum_i loss_weights[i] * loss_i``, equal weights ``1/labels`` by default.

    With ``sample_weights`` each loss must give one value per row (``losses`` are made so by
    :func:`unreduced`); as in Horovod the weighted loss is ``mean(loss_row * weight_row)``,
    not a weighted average, so two rows of equal weight count the same in any batch. A loss
    with several values per row (an ``[n, k]`` output) is averaged over them first.
    """
    check_output_count(len(outputs), len(labels))
    if loss_weights is None:
        loss_weights = [1.0 / len(outputs)] * len(outputs)
    total = None
    for loss_fn, out, lab, weight in zip(losses, outputs, labels, loss_weights, strict=True):
        value = loss_fn(out, match_output(lab, out))
        if sample_weights is not None:
            if value.dim() == 0:
                raise ValueError(
                    f"sample_weight_col needs a loss that returns one value per row; "
                    f"{metric_name(loss_fn)} returned a scalar. Use a torch loss module "
                    "(e.g. torch.nn.MSELoss()), a functional loss with a `reduction` argument "
                    "(e.g. torch.nn.functional.mse_loss) or one that returns per-row values"
                )
            per_row = value.reshape(value.shape[0], -1).mean(dim=1)
            value = (per_row * sample_weights.reshape(-1)).mean()
        elif value.dim() != 0:
            value = value.mean()
        # x * 1.0 is x bit for bit, and so is its gradient: one output of weight 1 (the default)
        # skips the product, one op fewer in forward and in backward per step (issue 45).
        term = value if float(weight) == 1.0 else value * float(weight)
        total = term if total is None else total + term
    assert total is not None  # as_list gives at least one output
    return total


def check_output_count(outputs: int, labels: int, label_cols: Sequence[str] = ()) -> None:
    """Raise :func:`output_count_error` when the counts of outputs and labels differ."""
    if outputs != labels:
        raise output_count_error(outputs, labels, label_cols)


def unreduced(loss_fn: Loss) -> Loss:
    """``loss_fn`` returning per-element losses, as Horovod calls it for sample weights.

    A torch loss module (anything with a string ``reduction`` attribute) is copied with
    ``reduction='none'``; a function that takes a ``reduction`` keyword (``F.mse_loss``,
    ``F.cross_entropy``, ...) is called with ``reduction='none'``; anything else is used as it
    is and must return per-row values itself.
    """
    import torch

    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, torch.nn.Module) and isinstance(reduction, str):
        if reduction == "none":
            return loss_fn
        clone = copy.copy(loss_fn)
        clone.reduction = "none"  # type: ignore[assignment]
        return clone
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return loss_fn
    if "reduction" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        partial = functools.partial(loss_fn, reduction="none")
        functools.update_wrapper(partial, loss_fn)
        return partial
    return loss_fn


def transform_outputs(
    outputs: Outputs, labels: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Horovod's ``transform_outputs``: outputs as a list, each label shaped like its output.

    A model that returns more or fewer outputs than there are label columns is refused, the
    count mismatch first (zip would otherwise drop the extra ones or fail without saying so).
    """
    outputs = as_list(outputs)
    if len(outputs) != len(labels):
        raise output_count_error(len(outputs), len(labels))
    return outputs, [match_output(lab, out) for lab, out in zip(labels, outputs)]


class LossFn:
    """Horovod's ``loss_fn(outputs, labels, sample_weights)`` handed to ``train_minibatch_fn``."""

    def __init__(self, losses: Sequence[Loss], loss_weights: list[float] | None, weighted: bool):
        self.losses = [unreduced(f) for f in losses] if weighted else list(losses)
        self.loss_weights = loss_weights

    def __call__(
        self,
        outputs: Outputs,
        labels: list[torch.Tensor],
        sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return compute_loss(
            self.losses, as_list(outputs), labels, self.loss_weights, sample_weights
        )


def output_count_error(outputs: int, labels: int, label_cols: Sequence[str] = ()) -> ValueError:
    """The error of a model whose number of outputs differs from the label columns'."""
    named = f" {list(label_cols)!r}" if label_cols else ""
    return ConfigurationError(
        f"the model returns {outputs} output(s) but there are {labels} label column(s){named}: "
        "each output is compared with one label column, in order, so return one output per "
        "label column (a tuple for several), or list one label column per output in label_cols"
    )


def match_output(label: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Reshape a label to its output's shape when both hold as many values (Horovod's rule)."""
    if label.shape != output.shape and label.numel() == output.numel():
        return label.reshape(output.shape)
    return label


def as_list(outputs: Outputs) -> list[torch.Tensor]:
    """A model's output(s) as a list."""
    return list(outputs) if isinstance(outputs, list | tuple) else [outputs]
