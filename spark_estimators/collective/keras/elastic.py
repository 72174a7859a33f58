"""``hvd.elastic`` for Keras: ``import spark_estimators.collective.keras as hvd; hvd.elastic``.

What ``horovod.tensorflow.keras.elastic`` offers, for Keras 3 on TensorFlow:

- :class:`KerasState` (``KerasState(model, optimizer=None, **kwargs)``): the model's and the
  optimizer's variables plus picklable attributes (``epoch``, ``batch``), committed, restored
  and synced like :class:`~spark_estimators.collective.tensorflow.elastic.TensorFlowKerasState`;
- the callbacks that keep the state in step with ``model.fit``: :class:`CommitStateCallback`
  (commit every ``batches_per_commit`` batches and at each epoch's end),
  :class:`UpdateBatchStateCallback` (``state.batch``), :class:`UpdateEpochStateCallback`
  (``state.epoch`` counted across resets);
- ``run``, ``State``, ``ObjectState``, ``HostsUpdatedInterrupt``, as the other adapters.

Keras 3 difference: horovod's ``UpdateBatchStateCallback`` shortens the epoch that resumes after
a reset by rewriting ``params["steps"]``; Keras 3 sizes its epochs from the data iterator and
ignores that entry, so a reset in the middle of an epoch runs that epoch in full again (the
committed weights are kept). Pass ``epochs=epochs - state.epoch`` to ``fit`` as horovod's example
does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import keras

from spark_estimators.collective.common_elastic import *  # noqa: F403
from spark_estimators.collective.common_elastic import __all__ as _common_all
from spark_estimators.collective.tensorflow.elastic import TensorFlowKerasState

if TYPE_CHECKING:
    from spark_estimators.collective.api.elastic import BroadcastObject, State

#: What Keras hands a callback: metric name -> value.
Logs = dict[str, float]


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model and its optimizer, plus attributes (horovod's name).

    Parameters
    ----------
    model
        The Keras model; its variables are saved on commit and broadcast from rank 0 on sync.
    optimizer
        Default ``model.optimizer``; its variables too, once built.
    **kwargs
        Other attributes (``epoch=0``, ``batch=0``), handled as by ``ObjectState``.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(model, optimizer, bcast_object, get_rank, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Count from the start again (every rank after a reset)."""
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Commit when ``batches_per_commit`` batches have ended since the last commit."""
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Commit at every epoch's end."""
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the last batch that ended (0 after an epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Record the batch number."""
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """An epoch ended: the next starts at batch 0."""
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs done, counted across resets."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = int(getattr(state, "epoch", 0))

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Keras counts from 0 in every ``fit``: remember where this one starts."""
        self.initial_epoch = int(getattr(self.state, "epoch", 0))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Epochs done = where this ``fit`` started + Keras's epoch + 1."""
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]


__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    *_common_all,
]
