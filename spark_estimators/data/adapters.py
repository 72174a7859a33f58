"""Framework adapters for :class:`~spark_estimators.data.reader.BatchReader` batches.

:func:`converted_epoch` is the one way batches are converted while an epoch is read (the
estimators' ranks use it through :mod:`spark_estimators.core.batches`). torch and tensorflow are
imported inside the functions only, so importing this module (and the
rest of :mod:`spark_estimators.data`) never loads a framework.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf
    import torch

    from spark_estimators.data._pipeline import Batch, BlockFormat


class BatchSource(Protocol):
    """A rank's reader as the adapters see it (BatchReader, StreamBatchReader, petastorm's)."""

    batch_size: int

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches per epoch (None: a stream reader before its data is all read)."""
        ...

    def __iter__(self) -> Iterator[Batch]:
        """The next epoch's batches."""
        ...

    def peek(self) -> Batch:
        """The first batch, without starting an epoch."""
        ...


class TorchBatches:
    """Iterable of ``{column: torch.Tensor}`` per batch; ``len()`` is the reader's steps.

    Each decoded block becomes tensors once, in the reader's background thread
    (``torch.from_numpy``, no copy; ``shapes`` and ``dtypes`` applied there too), and batches are
    views of them. ``shapes`` reshapes columns per row (e.g. ``{"image": (1, 28, 28)}``);
    ``dtypes`` converts (e.g. ``{"features": torch.float32}``). ``pin_memory``: batches in pinned
    host memory, for ``to(device, non_blocking=True)``; ``None`` (default) pins when this
    process has initialised CUDA (:mod:`spark_estimators.data._staging`).
    """

    def __init__(
        self,
        reader: BatchSource,
        shapes: Mapping[str, Sequence[int]] | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.reader = reader
        self.shapes = {k: tuple(v) for k, v in (shapes or {}).items()}
        self.dtypes = dict(dtypes or {})
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        return int(cast(int, self.reader.steps_per_epoch))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        import torch

        from spark_estimators.data.reader import BlockFormat

        shapes, dtypes = self.shapes, self.dtypes

        def to_tensors(block: Batch) -> dict[str, torch.Tensor]:
            out = {}
            for name, values in block.items():
                tensor = torch.from_numpy(values)
                if name in shapes:
                    tensor = tensor.reshape(-1, *shapes[name])
                if name in dtypes:
                    tensor = tensor.to(dtypes[name])
                out[name] = tensor
            return out

        fmt = BlockFormat(convert=to_tensors, concat=torch.cat, pin_memory=self.pin_memory)
        tensors = converted_epoch(self.reader, fmt)
        return cast("Iterator[dict[str, torch.Tensor]]", tensors)


def converted_epoch(reader: BatchSource, block_format: BlockFormat) -> Iterator[dict[str, object]]:
    """The reader's next epoch, each batch converted by ``block_format.convert``.

    Our Arrow reader converts whole decoded blocks in its prefetch thread and slices batches out
    of them (:meth:`~spark_estimators.data.reader.BatchReader.iter_epoch`); readers without
    blocks (petastorm) convert each batch. The estimators' ranks read through this too
    (:func:`spark_estimators.core.batches.epoch_batches`).
    """
    iter_epoch = getattr(reader, "iter_epoch", None)
    if iter_epoch is not None:
        return iter(iter_epoch(block_format))
    from spark_estimators.data._staging import stage_block, staging_allocator

    staging = staging_allocator(block_format.pin_memory, block_format.staging)
    if staging is None:
        return (block_format.convert(batch) for batch in reader)
    return (stage_block(block_format.convert(batch), staging) for batch in reader)


def torch_batches(
    reader: BatchSource,
    shapes: Mapping[str, Sequence[int]] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    pin_memory: bool | None = None,
) -> TorchBatches:
    """Wrap a reader so it yields dicts of torch tensors (see :class:`TorchBatches`).

    >>> for batch in torch_batches(reader):  # doctest: +SKIP
    ...     loss = loss_fn(model(batch["features"]), batch["label"])
    """
    return TorchBatches(reader, shapes, dtypes, pin_memory)


def tf_dataset(
    reader: BatchSource,
    feature_cols: Sequence[str],
    label_cols: Sequence[str] = (),
    sample_weight_col: str | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(x, y[, sample_weight])`` batches for Keras ``fit``.

    ``x`` (and ``y``) is one tensor for one column, else a tuple in the given order. Each pass over
    the dataset runs the reader's next epoch; its cardinality is ``reader.steps_per_epoch`` and the
    batch dimension is static (every batch is full).
    """
    import tensorflow as tf

    shapes = {k: tuple(v) for k, v in (shapes or {}).items()}
    sample = reader.peek()
    batch_size = int(reader.batch_size)

    def spec(name: str) -> tf.TensorSpec:
        if name not in sample:
            raise KeyError(f"column {name!r} is not in the reader's batches {sorted(sample)!r}")
        row_shape = shapes.get(name, sample[name].shape[1:])
        return tf.TensorSpec((batch_size, *row_shape), tf.as_dtype(sample[name].dtype), name=name)

    def group(names: Sequence[str]) -> tf.TensorSpec | tuple[tf.TensorSpec, ...]:
        specs = tuple(spec(n) for n in names)
        return specs[0] if len(specs) == 1 else specs

    signature: tuple[tf.TensorSpec | tuple[tf.TensorSpec, ...], ...] = (group(feature_cols),)
    if label_cols:
        signature += (group(label_cols),)
    if sample_weight_col:
        signature += (spec(sample_weight_col),)

    def pick(batch: Batch, names: Sequence[str]) -> np.ndarray | tuple[np.ndarray, ...]:
        arrays = tuple(
            batch[n].reshape((len(batch[n]), *shapes[n])) if n in shapes else batch[n]
            for n in names
        )
        return arrays[0] if len(arrays) == 1 else arrays

    def generate() -> Iterator[tuple[np.ndarray | tuple[np.ndarray, ...], ...]]:
        for batch in reader:
            item: tuple[np.ndarray | tuple[np.ndarray, ...], ...] = (pick(batch, feature_cols),)
            if label_cols:
                item += (pick(batch, label_cols),)
            if sample_weight_col:
                item += (batch[sample_weight_col],)
            yield item

    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    if reader.steps_per_epoch is None:  # data="stream" before its data is read: unknown length
        return dataset
    return dataset.apply(tf.data.experimental.assert_cardinality(int(reader.steps_per_epoch)))
