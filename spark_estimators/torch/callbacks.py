"""Callbacks for TorchEstimator (they run on every rank with rank-averaged metrics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


class EarlyStopping:
    """Stop training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Metrics are averaged over the ranks before callbacks run, so every rank takes the same
    decision; the estimator also agrees on it with an allreduce.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "min",
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is not 'min' or 'max'")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best: float | None = None
        self.wait = 0
        self.stop_training = False
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float]) -> None:
        """Track the monitored metric; stop after more than ``patience`` epochs without gain."""
        if self.monitor not in logs:
            raise KeyError(
                f"EarlyStopping monitors {self.monitor!r}, which is not among the logged "
                f"metrics {sorted(logs)!r}"
            )
        value = float(logs[self.monitor])
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stop_training = True
            self.stopped_epoch = epoch


# Learning-rate keys a scheduler keeps next to ``lr`` in the optimizer's param groups, and its
# own per-group lists: all scaled together so that scale_lr survives the scheduler's steps.
GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LR_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")


def scale_learning_rates(
    optimizer: torch.optim.Optimizer, callbacks: Sequence[object], factor: float
) -> None:
    """Multiply the optimizer's learning rates by ``factor``, schedules included.

    The param groups' ``lr`` and the keys schedulers keep beside it (``initial_lr``,
    ``max_lr``, ``min_lr``), and the schedules of the callbacks that have ``scale_schedule``
    (:class:`LearningRateScheduler`): a scheduler otherwise steps back to its unscaled rates.
    """
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in GROUP_LR_KEYS:
            if isinstance(group.get(key), int | float) and not isinstance(group[key], bool):
                group[key] = group[key] * factor
    for cb in callbacks:
        scale = getattr(cb, "scale_schedule", None)
        if scale is not None:
            scale(factor)


class LearningRateScheduler:
    """Step a ``torch.optim.lr_scheduler`` scheduler during a TorchEstimator fit.

    Build the scheduler on the same optimizer you give the estimator, in the driver; it travels
    with the model and optimizer (pickled together), so on the ranks it steps the rank's
    optimizer. Each epoch's ``lr`` (the first param group's rate during that epoch) is added to
    the epoch's logs, so ``getHistory()["lr"]`` shows the schedule.

    - ``interval="epoch"`` (default): ``scheduler.step()`` after each epoch (after validation);
      ``ReduceLROnPlateau`` gets ``logs[monitor]`` (default ``val_loss``, else ``loss``).
    - ``interval="step"``: ``scheduler.step()`` after every optimizer step (every
      ``backward_passes_per_step`` batches), e.g. ``OneCycleLR``.
    - ``scale_lr=True`` (the default) multiplies every learning rate of the schedule by the number
      of ranks: ``lr``, ``initial_lr``, ``max_lr``, ``min_lr`` of the param groups and the
      scheduler's ``base_lrs`` / ``max_lrs`` / ``min_lrs``, so ``OneCycleLR(max_lr=0.1)`` peaks
      at ``0.1 * num_proc``; ``scale_lr=False`` keeps the schedule as given.
    - The scheduler's state is in every checkpoint: a hot start (same ``run_id``) goes on with the
      schedule where it stopped.

    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)  # doctest: +SKIP
    >>> sched = LearningRateScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    ... # doctest: +SKIP
    >>> TorchEstimator(model=model, optimizer=opt, callbacks=[sched], ...)  # doctest: +SKIP
    """

    def __init__(
        self,
        scheduler: LRScheduler,
        interval: str = "epoch",
        monitor: str = "val_loss",
    ):
        if interval not in ("epoch", "step"):
            raise ValueError(f"interval={interval!r} is not 'epoch' or 'step'")
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "optimizer"):
            raise TypeError(
                f"scheduler must be a torch.optim.lr_scheduler scheduler built on the "
                f"estimator's optimizer, got {type(scheduler).__name__}"
            )
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the scheduler steps."""
        return self.scheduler.optimizer

    def _plateau(self) -> ReduceLROnPlateau | None:
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        return self.scheduler if isinstance(self.scheduler, ReduceLROnPlateau) else None

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float]) -> None:
        """After an optimizer step: step a per-step schedule."""
        if self.interval == "step" and self._plateau() is None:
            self.scheduler.step()

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Record the epoch's ``lr``, then step a per-epoch schedule."""
        logs["lr"] = float(self.optimizer.param_groups[0]["lr"])
        plateau = self._plateau()
        if plateau is not None:
            key = self.monitor if self.monitor in logs else "loss"
            plateau.step(float(logs[key]))
        elif self.interval == "epoch":
            self.scheduler.step()

    def scale_schedule(self, factor: float) -> None:
        """Multiply the scheduler's own learning rates (the estimator scales the groups')."""
        for name in _SCHEDULER_LR_LISTS:
            values = getattr(self.scheduler, name, None)
            if isinstance(values, list | tuple):
                setattr(self.scheduler, name, [v * factor for v in values])

    def state_dict(self) -> dict[str, dict[str, object]]:
        """The scheduler's state (saved in every checkpoint)."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, dict[str, object]]) -> None:
        """Restore the scheduler's state (hot start)."""
        self.scheduler.load_state_dict(state["scheduler"])
