"""FrameworkState: how save/restore/sync combine framework objects and attributes."""

from __future__ import annotations

import pytest

from spark_estimators.collective.common_elastic import FrameworkState


class ListState(FrameworkState):
    """A framework object that is a list of floats; rank 0's list is ``[9.0, 9.0]``."""

    def __init__(self, weights: list[float], **kwargs: object) -> None:
        self.weights = weights
        self.saved: list[float] = []
        # one process: bcast_object hands back what rank 0 sent, i.e. the object itself
        super().__init__(lambda obj, root_rank: obj, lambda: 0, **kwargs)

    def _save_objects(self) -> None:
        self.saved = list(self.weights)

    def _restore_objects(self) -> None:
        self.weights = list(self.saved)

    def _broadcast_objects(self) -> None:
        self.weights = [9.0, 9.0]


def test_construction_saves_and_restore_puts_objects_and_attributes_back():
    state = ListState([1.0, 2.0], epoch=0)
    assert state.saved == [1.0, 2.0]
    state.weights, state.epoch = [5.0, 5.0], 3
    state.commit()
    state.weights, state.epoch = [7.0, 7.0], 4
    state.restore()
    assert (state.weights, state.epoch) == ([5.0, 5.0], 3)


def test_sync_takes_rank_zero_objects_and_commits_them():
    state = ListState([1.0, 2.0], epoch=2)
    state.epoch = 6
    state.sync()
    # the attributes come from the last save (rank 0's), the objects from the broadcast
    assert (state.weights, state.epoch) == ([9.0, 9.0], 2)
    state.weights = [0.0, 0.0]
    state.restore()
    assert state.weights == [9.0, 9.0]


def test_a_subclass_must_say_how_to_broadcast_its_objects():
    class NoBroadcast(FrameworkState):
        def _save_objects(self) -> None:
            pass

        def _restore_objects(self) -> None:
            pass

    with pytest.raises(TypeError, match="_broadcast_objects"):
        NoBroadcast()
