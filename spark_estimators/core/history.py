"""``Model.getHistory()``: per-epoch metrics that also answer horovod's ``history['val_loss']``.

A fitted model's history is a list with one dict per epoch (``{"epoch": 0, "loss": ...,
"val_loss": ...}``), averaged over the ranks. horovod's ``KerasModel.getHistory()`` returned Keras's
``History.history`` instead, a dict of metric name -> list of per-epoch values, and ported scripts
index it that way (``min(history['val_loss'])``). :class:`History` is both: a ``list`` of the
per-epoch dicts (indexing by position, iteration, ``len`` = epochs) that also takes a metric name
as a key and has the dict methods ``keys``, ``items``, ``values``, ``get`` and ``as_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import SupportsIndex, TypeVar, overload

_D = TypeVar("_D")


class History(list[dict[str, float]]):
    """Per-epoch metric dicts; ``history[name]`` is that metric's value per epoch.

    >>> h = History([{"epoch": 0, "loss": 0.9}, {"epoch": 1, "loss": 0.4, "val_loss": 0.5}])
    >>> h[-1]["loss"], h["loss"], min(h["loss"])
    (0.4, [0.9, 0.4], 0.4)
    >>> h["val_loss"]  # an epoch without the metric gives None
    [None, 0.5]
    >>> sorted(h.keys()), "val_loss" in h, len(h)
    (['loss', 'val_loss'], True, 2)
    """

    def __init__(self, epochs: Iterable[dict[str, float]] = ()):
        super().__init__(dict(e) for e in epochs)

    @overload  # type: ignore[override]
    def __getitem__(self, key: SupportsIndex) -> dict[str, float]: ...
    @overload
    def __getitem__(self, key: slice) -> list[dict[str, float]]: ...
    @overload
    def __getitem__(self, key: str) -> list[float | None]: ...
    def __getitem__(
        self, key: SupportsIndex | slice | str
    ) -> dict[str, float] | list[dict[str, float]] | list[float | None]:
        """An epoch's dict by position, epochs by slice, or a metric's values by name."""
        if isinstance(key, str):
            if key not in self:
                raise KeyError(
                    f"no metric {key!r} in the history; metrics: {self.keys()} (each epoch is "
                    "also history[i], a dict)"
                )
            return [epoch.get(key) for epoch in self]
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        """A metric name: whether any epoch has it; else list membership of an epoch dict."""
        if isinstance(key, str):
            return any(key in epoch for epoch in self)
        return super().__contains__(key)

    def keys(self) -> list[str]:
        """The metric names, in the order they first appear (``epoch`` not included)."""
        names: dict[str, None] = {}
        for epoch in self:
            names.update((k, None) for k in epoch if k != "epoch")
        return list(names)

    def values(self) -> list[list[float | None]]:
        """Each metric's per-epoch values, in :meth:`keys` order."""
        return [self[name] for name in self.keys()]

    def items(self) -> Iterator[tuple[str, list[float | None]]]:
        """``(metric name, per-epoch values)`` pairs, as horovod's dict gave them."""
        return ((name, self[name]) for name in self.keys())

    @overload
    def get(self, key: str) -> list[float | None] | None: ...
    @overload
    def get(self, key: str, default: _D) -> list[float | None] | _D: ...
    def get(self, key: str, default: object = None) -> object:
        """A metric's per-epoch values, or ``default`` when no epoch has it."""
        if key not in self:
            return default
        return self[key]

    def as_dict(self) -> dict[str, list[float | None]]:
        """The form horovod's Keras history had: ``{metric name: [value per epoch]}``."""
        return dict(self.items())

    def __repr__(self) -> str:
        return f"History({list.__repr__(self)})"


__all__ = ["History"]
