"""Elastic training state and the ``run`` wrapper, framework-free (Horovod's ``hvd.elastic``).

A :class:`State` is what survives a reset: ``commit()`` saves it (and checks whether workers
were added), ``restore()`` goes back to the last commit, ``sync()`` copies rank 0's state to
every rank after a rendezvous. :func:`run` wraps a training function ``fn(state, ...)``:

* a :class:`~spark_estimators.errors.CollectiveError` that broke the group (a peer died) makes
  every survivor ``restore()`` the last commit, leave the group, meet the driver again (new
  ranks, possibly a new size) and ``sync()``; the function is then called again;
* :class:`HostsUpdatedInterrupt` (raised by ``commit()``/``check_host_updates()`` on every
  rank at once when the driver has new workers waiting) resets without restoring: the state was
  just committed.

Reset callbacks (``state.register_reset_callbacks([...])``) run after every reset, e.g. to
rescale the learning rate to the new ``size()``. Outside :func:`spark_estimators.run_elastic`
(no driver), a reset re-initialises the group with the same environment.

>>> from spark_estimators.collective.api import elastic
>>> state = elastic.ObjectState(epoch=0)  # doctest: +SKIP
>>> @elastic.run
... def train(state):
...     while state.epoch < 5:
...         ...
...         state.epoch += 1
...         state.commit()  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from spark_estimators.collective.api import lifecycle as _lifecycle
from spark_estimators.collective.api.numpy_ops import broadcast_object
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.errors import CollectiveError

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


class BroadcastObject(Protocol):
    """``bcast_object(obj, root_rank)``: ``root_rank``'s ``obj`` on every rank."""

    def __call__(self, obj: T, root_rank: int, /) -> T: ...


#: Set by the elastic rank process: meets the driver and sets the new rank's environment.
_rendezvous_hook: Callable[[], None] | None = None
#: Set by the elastic rank process: True when the driver has a newer set of workers.
_host_update_hook: Callable[[], bool] | None = None


def set_driver_hooks(
    rendezvous: Callable[[], None] | None, host_updates: Callable[[], bool] | None
) -> None:
    """Install the driver callbacks (done by :mod:`spark_estimators.elastic.worker`)."""
    global _rendezvous_hook, _host_update_hook
    _rendezvous_hook, _host_update_hook = rendezvous, host_updates


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Raised on every rank by ``commit()`` when workers joined or left; triggers a reset.

    Parameters
    ----------
    skip_sync
        True when workers only left (every rank already holds the committed state).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of workers changed")
        self.skip_sync = skip_sync

    def __reduce__(self) -> tuple[type[HostsUpdatedInterrupt], tuple[bool]]:
        return (type(self), (self.skip_sync,))


def _broadcast_object(obj: T, root_rank: int = 0) -> T:
    return broadcast_object(obj, root_rank=root_rank, name="elastic.state")


class State:
    """Base of elastic states: commit / restore / sync and reset callbacks.

    Parameters
    ----------
    bcast_object
        ``bcast_object(obj, root_rank)``; default
        :func:`spark_estimators.collective.broadcast_object`.
    get_rank
        Returns this process's rank; default :func:`spark_estimators.collective.rank`.
    """

    def __init__(
        self,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or _broadcast_object
        self._get_rank = get_rank or _lifecycle.rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the registered reset callbacks (called after every reset)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state as the point to go back to, then check for new or lost workers."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the workers changed.

        Rank 0 asks the driver and broadcasts the answer, so all ranks raise at the same step.
        """
        updated = False
        if self._get_rank() == 0 and _host_update_hook is not None:
            updated = bool(_host_update_hook())
        if self._bcast_object(updated, 0):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Remember the current state as the one :meth:`restore` goes back to."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the state of the last :meth:`save`."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank hold rank 0's state (after a rendezvous)."""
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable attributes: ``ObjectState(epoch=0, batch=0)``.

    Each keyword becomes an attribute; ``save()`` deep-copies them, ``restore()`` puts the
    copies back, ``sync()`` broadcasts rank 0's saved values.
    """

    def __init__(
        self,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        """Copy the attributes as the point :meth:`restore` goes back to."""
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        """Put back the attribute values of the last :meth:`save`."""
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Broadcast rank 0's saved attributes and restore them on every rank."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0)
            self.restore()


S = TypeVar("S", bound=State)


def _group_broken() -> bool:
    current = _engine.current()
    return current is not None and current.broken is not None


def reset() -> None:
    """Leave the collective group, meet the driver again and re-join with the new ranks."""
    _lifecycle.shutdown()
    if _rendezvous_hook is not None:
        _rendezvous_hook()
    _lifecycle.init()


def run(func: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Decorate ``func(state, *args, **kwargs)`` to survive failed and added workers.

    See the module docstring. A :class:`CollectiveError` that did not break the group (e.g.
    tensors of different shapes on different ranks) is a bug in the caller and is re-raised.
    """

    @functools.wraps(func)
    def wrapper(state: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if not _lifecycle.is_initialized():
            _lifecycle.init()
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except CollectiveError as exc:
                if not _group_broken():
                    raise
                logger.info("a peer failed (%s): restoring the last commit", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                logger.info("workers changed: resetting")
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()

    return wrapper


__all__ = [
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "reset",
    "run",
    "set_driver_hooks",
]
