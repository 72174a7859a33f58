"""Callbacks for TorchEstimator (they run on every rank with rank-averaged metrics)."""

from __future__ import annotations

from typing import Any


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

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
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
