"""Keras callbacks of ``horovod.tensorflow.keras.callbacks``, for Keras 3.

Order matters: put :class:`BroadcastGlobalVariablesCallback` and :class:`MetricAverageCallback`
**first** in ``callbacks=[...]``. Keras calls callbacks in list order with one shared ``logs``
dict, so callbacks after ``MetricAverageCallback`` (``EarlyStopping``, ``ModelCheckpoint``,
``ReduceLROnPlateau``, ``History``) see metrics averaged over the ranks and take the same
decision on every rank; before it they would see this rank's values, and ranks could stop at
different epochs (the next collective then hangs or fails).

>>> import spark_estimators.collective.keras as hvd
>>> callbacks = [
...     hvd.callbacks.BroadcastGlobalVariablesCallback(0),
...     hvd.callbacks.MetricAverageCallback(),
...     hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=3),
... ]  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, MutableMapping, Sequence

import keras
import numpy as np

from spark_estimators import collective as _core
from spark_estimators.collective.keras.optimizer import check_initialized

logger = logging.getLogger(__name__)

#: What Keras hands a callback: metric name -> value.
Logs = MutableMapping[str, float]


def broadcast_variables(
    variables: Sequence[keras.Variable], root_rank: int = 0, name: str = "bcast"
) -> None:
    """Overwrite ``variables`` with ``root_rank``'s values: one broadcast per dtype.

    Parameters
    ----------
    variables
        Keras or TensorFlow variables, in the same order on every rank.
    root_rank
        The rank whose values win.
    name
        Name of the collective ops (must be the same on every rank).
    """
    check_initialized("broadcast_variables")
    if _core.size() == 1 or not variables:
        return
    groups: dict[str, list[keras.Variable]] = {}
    for v in variables:
        groups.setdefault(np.dtype(keras.backend.standardize_dtype(v.dtype)).name, []).append(v)
    for dtype_name in sorted(groups):
        vs = groups[dtype_name]
        arrays = [np.asarray(keras.ops.convert_to_numpy(v)) for v in vs]
        flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0)
        flat = np.ascontiguousarray(flat, dtype=np.dtype(dtype_name))
        _core.broadcast_(flat, root_rank, name=f"{name}.{dtype_name}")
        offset = 0
        for v, a in zip(vs, arrays, strict=True):
            v.assign(flat[offset : offset + a.size].reshape(a.shape))
            offset += a.size


def average_logs(logs: Logs, name: str = "metric_average") -> Logs:
    """Average the numeric entries of ``logs`` over the ranks, in place, with one allreduce."""
    check_initialized("MetricAverageCallback")
    keys = sorted(k for k, v in logs.items() if _is_number(v))
    if _core.size() == 1 or not keys:
        return logs
    values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
    _core.allreduce_(values, op=_core.Average, name=f"{name}[{','.join(keys)}]")
    for key, value in zip(keys, values, strict=True):
        logs[key] = float(value)
    return logs


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Number):
        return True
    return isinstance(value, np.ndarray | np.generic) and np.ndim(value) == 0


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s model and optimizer state.

    Broadcasts ``model.variables`` (trainable, non-trainable, seed-generator state) and
    ``model.optimizer.variables`` (iteration counter, slots) once per ``fit``:

    - in ``on_train_begin`` when the model already has its variables (a functional model, or a
      ``Sequential`` with an ``Input``); an optimizer not built yet is built here for them;
    - else after the first batch, as horovod does (``on_train_batch_end``): a ``Sequential``
      without an ``Input``, a subclassed ``keras.Model`` or one with its own ``train_step`` gets
      its variables, and the optimizer its slots, only inside the first step. Building the
      optimizer before would tie it to no variables ("Unknown variable ... This optimizer can
      only be called for the variables it was originally built with"). The first step then runs
      from each rank's own initial weights; the broadcast after it makes the ranks equal.

    ``local_variables``: variables (or a list of them) that stay each rank's own (horovod's
    argument): they are left out of the broadcast.
    """

    def __init__(
        self,
        root_rank: int = 0,
        device: str = "",
        local_variables: keras.Variable | Sequence[keras.Variable] | None = None,
    ):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, list | tuple):
            local_variables = [local_variables]
        self._local_ids = {id(v) for v in local_variables}
        self.broadcast_done = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Broadcast from ``root_rank`` now if the model has its variables (else after batch 1)."""
        self.broadcast_done = False
        if self.model.trainable_variables:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Broadcast after the first batch when the model had no variables before it."""
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        shared = [v for v in model.variables if id(v) not in self._local_ids]
        broadcast_variables(shared, self.root_rank, name="bcast.model")
        if optimizer is not None:
            broadcast_variables(optimizer.variables, self.root_rank, name="bcast.optimizer")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's logs (``loss``, metrics, ``val_*``) by their mean over the ranks.

    Put it before any callback that reads the logs (see the module docstring). One allreduce of
    all numeric entries per epoch.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Average the epoch's metrics across ranks in ``logs``."""
        if logs is not None:
            average_logs(logs)


def _get_lr(optimizer: keras.optimizers.Optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between two epochs.

    Parameters
    ----------
    initial_lr
        The rate ``multiplier`` scales (required, as in Horovod).
    multiplier
        ``fn(epoch) -> float`` (``epoch`` is fractional when ``staircase=False``), or a constant
        ``c`` meaning ``c ** epoch``.
    start_epoch, end_epoch
        The half-open epoch range the schedule applies to.
    staircase
        True: adjust at the first batch of an epoch; False: at every batch.
    momentum_correction
        Scale the momentum by ``new_lr / old_lr`` for the step of each change (Goyal et al.).
        Works only when the optimizer's momentum is a variable; Keras 3's built-in optimizers
        keep it as a Python float that the compiled step has captured, so it is skipped there.
    steps_per_epoch
        Batches per epoch; default from ``fit``.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: Callable[[float], float] | float,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor**epoch
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Remember the initial learning rate and the steps per epoch."""
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    f"{type(self).__name__} could not detect the steps per epoch: pass "
                    "steps_per_epoch=..."
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Set the learning rate for this epoch when the schedule is per epoch."""
        self.current_epoch = epoch

    def _in_scope(self) -> bool:
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch
        )

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum: object = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr > 0:
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Set the learning rate for this step when the schedule is per batch."""
        if not self._in_scope():
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            assert self.steps_per_epoch
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Put back the momentum that the learning-rate change of this step scaled."""
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Record the learning rate of the epoch in ``logs``."""
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` (Goyal et al.).

    Over ``warmup_epochs`` epochs, adjusted at every batch, as Horovod's callback does. Give the
    already scaled rate as ``initial_lr`` (e.g. ``0.1 * hvd.size()``).

    Parameters
    ----------
    initial_lr
        The rate reached at the end of the warmup.
    warmup_epochs
        Length of the warmup.
    momentum_correction, steps_per_epoch
        As in :class:`LearningRateScheduleCallback`.
    verbose
        1 prints a line on rank 0 when the warmup ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that each epoch ends on a round value (as Horovod does).
            epoch += 1.0 / float(self.steps_per_epoch or 1)
            size = _core.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Record the learning rate; at the last warmup epoch, say that the warmup finished."""
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _core.rank() == 0:
            lr = _get_lr(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class StopTrainingAgreement(keras.callbacks.Callback):
    """Make every rank stop after an epoch when any rank's ``model.stop_training`` is set.

    Put it last: it ORs the flag over the ranks at the end of each epoch, so a callback that
    decided on this rank's own values cannot leave the other ranks waiting in an allreduce.
    """

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Stop on every rank when any rank's ``model.stop_training`` is set (a max-allreduce)."""
        check_initialized("StopTrainingAgreement")
        if _core.size() == 1:
            return
        flag = np.array([1.0 if self.model.stop_training else 0.0])
        _core.allreduce_(flag, op=_core.Max, name="stop_training")
        self.model.stop_training = bool(flag[0] > 0)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best epoch's model by a monitored metric: horovod's ``BestModelCheckpoint``.

    A ``ModelCheckpoint`` with ``save_best_only=True``. Give it to
    ``KerasEstimator(checkpoint_callback=...)``: rank 0 saves the model each time ``monitor``
    improves (the metric averaged over the ranks, so every rank agrees which epoch is best), the
    file lands in the run's ``checkpoints/`` in the store, and the fitted model carries the best
    epoch's weights instead of the last epoch's. ``getHistory()`` still has every epoch.

    Parameters
    ----------
    monitor
        The metric to watch (``"val_loss"`` needs ``validation=``).
    verbose
        1 prints a line when a checkpoint is saved.
    save_weights_only
        Save only the weights (``.weights.h5``) instead of the whole model (``.keras``).
    mode
        ``"auto"``, ``"min"`` or ``"max"``: which direction is better.
    save_freq
        ``"epoch"`` (horovod's default) or a number of batches.
    filepath
        Where to save: the estimator replaces the directory with the run's checkpoint
        directory and keeps the file name. Not in horovod's signature (it set the path itself).

    >>> from spark_estimators.collective.keras.callbacks import BestModelCheckpoint
    >>> ckpt = BestModelCheckpoint(monitor="val_loss", mode="min")  # doctest: +SKIP
    >>> est = KerasEstimator(..., checkpoint_callback=ckpt)  # doctest: +SKIP
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ):
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(
            filepath=filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )


__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "StopTrainingAgreement",
    "average_logs",
    "broadcast_variables",
]
