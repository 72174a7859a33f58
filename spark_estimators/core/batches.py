"""One batch converter for every framework's ranks: reader arrays -> model-ready columns.

The torch, Lightning and Keras ranks all feed their models what ``transform`` feeds them: each
column cast and shaped by :mod:`spark_estimators.core.tensors` (``input_shapes`` /
``label_shapes`` by :func:`~spark_estimators.core.tensors.shape_column`'s rule, where
``[-1, 1, 28, 28]`` is the whole batch's shape and a shape without the leading ``-1`` a per-row
one). The frameworks differ only in how a scalar column looks and in the array type:

=========  ==================  ================  ===========
framework  scalar feature      scalar label      arrays
=========  ==================  ================  ===========
torch      ``[batch, 1]``      ``[batch]``       torch (CPU)
lightning  ``[batch]``         ``[batch]``       torch (CPU)
keras      ``[batch, 1]``      ``[batch, 1]``    numpy
=========  ==================  ================  ===========

Columns in ``index_cols`` (class labels and embedding indices that the driver found floating,
e.g. from ``StringIndexer``) become int64 in every framework. A sample weight column is float32
``[batch]``. :func:`epoch_batches` runs one epoch of a reader
through a converter: with our Arrow reader the converter runs once per decoded block in the
reader's prefetch thread (:class:`~spark_estimators.data.reader.BlockFormat`) and batches are
slices of converted blocks, so the training thread only slices; readers without blocks
(petastorm) convert each batch. Moving tensors to a GPU stays with the framework (main thread).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_estimators.core import tensors

if TYPE_CHECKING:
    from spark_estimators.core.spec import TrainSpec


def _torch_cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts)


@dataclass(frozen=True)
class BatchConverter:
    """``{column: ndarray}`` from a reader -> ``{column: array or tensor}`` for a model.

    Parameters
    ----------
    feature_cols, label_cols : sequence of str
        The model's inputs and labels, in order.
    sample_weight_col : str or None
        A weight per row (float32 ``[batch]``), or None.
    input_shapes, label_shapes : list or None
        One shape (or None) per column, Horovod's rule (see the module docstring).
    scalar_features_as_column, scalar_labels_as_column : bool
        Whether a scalar column becomes ``[batch, 1]`` (else ``[batch]``).
    to_torch : bool
        Hand out CPU torch tensors (``torch.from_numpy``, no copy) instead of numpy arrays.
    index_cols : sequence of str
        Feature or label columns cast to int64 class indices, also when floating (their values
        must be whole numbers; see :func:`~spark_estimators.core.tensors.as_index_array`).

    Examples
    --------
    >>> convert = BatchConverter(["x"], ["y"], to_torch=False, scalar_labels_as_column=True)
    >>> out = convert({"x": np.arange(6.0).reshape(3, 2), "y": np.array([1, 0, 1])})
    >>> out["x"].dtype, out["x"].shape, out["y"].dtype, out["y"].shape
    (dtype('float32'), (3, 2), dtype('int64'), (3, 1))
    """

    feature_cols: Sequence[str]
    label_cols: Sequence[str] = ()
    sample_weight_col: str | None = None
    input_shapes: Sequence[Any] | None = None
    label_shapes: Sequence[Any] | None = None
    scalar_features_as_column: bool = True
    scalar_labels_as_column: bool = False
    to_torch: bool = True
    index_cols: Sequence[str] = ()

    @classmethod
    def for_spec(cls, spec: TrainSpec, **layout: bool) -> BatchConverter:
        """The converter of a train spec's columns and shapes; ``layout``: the bool fields."""
        return cls(
            spec.feature_cols,
            spec.label_cols,
            spec.sample_weight_col,
            spec.input_shapes,
            spec.label_shapes,
            index_cols=tuple(getattr(spec, "index_cols", None) or ()),
            **layout,
        )

    def arrays(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The converted columns as C-contiguous, writable numpy arrays."""
        out: dict[str, np.ndarray] = {}
        for cols, shapes, as_column in (
            (self.feature_cols, self.input_shapes, self.scalar_features_as_column),
            (self.label_cols, self.label_shapes, self.scalar_labels_as_column),
        ):
            for col, arr in zip(
                cols,
                tensors.model_inputs(batch, cols, shapes, as_column, self.index_cols),
                strict=True,
            ):
                out[col] = tensors.for_torch(arr)
        if self.sample_weight_col:
            weights = np.asarray(batch[self.sample_weight_col], dtype=np.float32).reshape(-1)
            out[self.sample_weight_col] = tensors.for_torch(weights)
        return out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Convert one batch (or one decoded block)."""
        out = self.arrays(batch)
        if not self.to_torch:
            return dict(out)
        import torch

        return {col: torch.from_numpy(arr) for col, arr in out.items()}

    def inputs(self, batch: dict[str, Any]) -> list[Any]:
        """The converted batch's feature columns, in ``feature_cols`` order."""
        return [batch[col] for col in self.feature_cols]

    def block_format(self) -> Any:
        """The converter as the reader's per-block conversion (run in its prefetch thread)."""
        from spark_estimators.data.reader import BlockFormat

        return BlockFormat(convert=self, concat=_torch_cat if self.to_torch else np.concatenate)


def epoch_batches(
    reader: Any,
    convert: BatchConverter,
    steps: int | None = None,
    epoch: int | None = None,
) -> Iterator[dict[str, Any]]:
    """One epoch of ``reader`` converted by ``convert``: ``steps`` batches (default: all).

    ``epoch`` sets the reader's epoch (its shuffle order) first. With ``steps`` beyond the
    reader's ``steps_per_epoch`` (backward passes per step rounded up, see
    :func:`~spark_estimators.core.rank.epoch_steps`) the rank wraps around its shard: the epoch's
    order starts again for the missing batches, as the reader itself wraps a short shard. The
    reader's prefetch thread stops when the generator finishes or is closed, also after fewer
    batches than an epoch; afterwards the reader stands at the next epoch either way.
    """
    from spark_estimators.data.adapters import converted_epoch

    if epoch is not None:
        reader.set_epoch(epoch)
    start = int(getattr(reader, "epoch", 0) or 0)
    if steps is None:
        iterator = converted_epoch(reader, convert.block_format())
        try:
            yield from iterator
        finally:
            _close(iterator)
        return
    left = steps
    while left > 0:
        reader.set_epoch(start)
        iterator = converted_epoch(reader, convert.block_format())
        try:
            for batch in iterator:
                yield batch
                left -= 1
                if left == 0:
                    break
            else:
                if left == steps:  # no rows at all (then no rank has any): nothing to wrap
                    break
        finally:
            _close(iterator)
    reader.set_epoch(start + 1)


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
