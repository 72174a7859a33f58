"""What ``hvd.elastic`` of the torch and TensorFlow adapters share: :class:`FrameworkState`.

:class:`~spark_estimators.collective.torch.elastic.TorchState` and
:class:`~spark_estimators.collective.tensorflow.elastic.TensorFlowState` hold framework objects
(a model's weights, an optimizer's state) besides the picklable attributes of
:class:`~spark_estimators.collective.api.elastic.ObjectState`. How ``save``, ``restore`` and
``sync`` combine the two is the same for both and is written here once; each adapter says only
how to copy, put back and broadcast its objects. ``__all__`` lists the framework-free names that
every adapter's ``hvd.elastic`` re-exports. This module imports no framework.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from spark_estimators.collective.api.elastic import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reset,
    run,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from spark_estimators.collective.api.elastic import BroadcastObject


class FrameworkState(ObjectState, abc.ABC):
    """An :class:`ObjectState` that also holds framework objects, saved before the attributes.

    Subclasses set their objects before calling ``__init__`` (which saves them) and implement
    the three abstract methods: ``_save_objects`` (copy them), ``_restore_objects`` (put the
    copy back) and ``_broadcast_objects`` (overwrite them with rank 0's).
    """

    def __init__(
        self,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(bcast_object, get_rank, **kwargs)
        self._save_objects()

    @abc.abstractmethod
    def _save_objects(self) -> None:
        """Copy the framework objects as the point :meth:`restore` goes back to."""

    @abc.abstractmethod
    def _restore_objects(self) -> None:
        """Put the copy of the last :meth:`_save_objects` back."""

    @abc.abstractmethod
    def _broadcast_objects(self) -> None:
        """Overwrite the framework objects with rank 0's."""

    def save(self) -> None:
        """Copy the framework objects, then the attributes."""
        self._save_objects()
        super().save()

    def restore(self) -> None:
        """Put the saved framework objects back, then the attributes."""
        self._restore_objects()
        super().restore()

    def sync(self) -> None:
        """Broadcast rank 0's objects and attributes; every rank then commits that point."""
        self._broadcast_objects()
        if self._saved_state:
            # ObjectState.sync would call self.restore(), which puts this rank's own saved
            # objects back over the ones just broadcast: sync only the attributes here.
            self._saved_state = self._bcast_object(self._saved_state, 0)
            ObjectState.restore(self)
        self._save_objects()  # every rank now goes back to the same point on the next failure


__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "reset", "run"]
