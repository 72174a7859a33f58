"""``hvd.elastic`` for torch: :class:`TorchState` plus the framework-free pieces.

Exposed as ``spark_estimators.collective.torch.elastic``::

    import spark_estimators.collective.torch as hvd

    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from spark_estimators.collective import common_elastic as _common
from spark_estimators.collective.common_elastic import *  # noqa: F403
from spark_estimators.collective.common_elastic import FrameworkState

if TYPE_CHECKING:
    import torch

    from spark_estimators.collective.api.elastic import BroadcastObject


class TorchState(FrameworkState):
    """Elastic state of a torch model and optimizer, plus any picklable attributes.

    Parameters
    ----------
    model
        A ``torch.nn.Module``; its ``state_dict`` is saved on commit and broadcast from rank 0
        on sync.
    optimizer
        A ``torch.optim.Optimizer``; its ``state_dict`` (momentum buffers, step counts) likewise.
        New workers may hold no optimizer state yet: it travels as an object.
    **kwargs
        Other attributes (``epoch``, ``batch``, counters), handled as by :class:`ObjectState`.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._saved_model: dict[str, torch.Tensor] | None = None
        self._saved_optimizer: dict[str, object] | None = None
        super().__init__(bcast_object, get_rank, **kwargs)

    def _save_objects(self) -> None:
        """Copy the model's and optimizer's state dicts."""
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())

    def _restore_objects(self) -> None:
        """Load the saved model and optimizer state."""
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)

    def _broadcast_objects(self) -> None:
        """Broadcast rank 0's model and optimizer state (new workers may have none yet)."""
        from spark_estimators.collective.torch.exchange import broadcast_parameters

        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            opt_state = self.optimizer.state_dict() if self._get_rank() == 0 else None
            opt_state = self._bcast_object(opt_state, 0)
            assert opt_state is not None  # rank 0's, on every rank
            self.optimizer.load_state_dict(opt_state)


__all__ = ["TorchState", *_common.__all__]
