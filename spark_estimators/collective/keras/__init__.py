"""The Keras adapter: ``import spark_estimators.collective.keras as hvd``.

It replaces ``import horovod.tensorflow.keras as hvd`` for Keras 3 on TensorFlow: ``init``,
``rank``, ``size``, ``local_rank``, ... (shared with :mod:`spark_estimators.collective`),
:func:`DistributedOptimizer`, the callbacks (``hvd.callbacks.BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, ``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``,
also importable from this module), :func:`load_model`, ``Compression``, and eager tensor ops
(:func:`allreduce`, :func:`allgather`, :func:`broadcast`, :func:`broadcast_variables`, the
``*_object`` helpers, :func:`barrier`) on TensorFlow tensors, Keras variables or numpy arrays.

Why the optimizer (and not ``MultiWorkerMirroredStrategy``): see
:mod:`spark_estimators.collective.keras.optimizer`. In short, ``model.fit`` keeps its real
semantics (compile-time metrics, every callback, ``History``) and gradients are averaged in
``Optimizer.apply`` with one fused allreduce per step.

A Horovod script ports by changing its import::

    import spark_estimators.collective.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"], jit_compile=False)
    model.fit(dataset, epochs=5, verbose=1 if hvd.rank() == 0 else 0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=1e-3 * hvd.size(), warmup_epochs=2),
    ])

Run it with ``python -m spark_estimators.launch -np 2 train.py`` or inside
:func:`spark_estimators.run`. ``jit_compile=False`` is required (XLA cannot compile the
allreduce's ``py_function``); :func:`DistributedOptimizer` cannot enforce it, ``fit`` then
fails with an XLA error naming ``EagerPyFunc``.
"""

from __future__ import annotations

from typing import TypeAlias

from spark_estimators.collective.requires import requires_extra

with requires_extra("spark_estimators.collective.keras", "TensorFlow and Keras 3", "keras"):
    import keras
    import tensorflow as tf

import numpy as np

from spark_estimators import collective as _core
from spark_estimators.collective import api as _api
from spark_estimators.collective.api import *  # noqa: F403
from spark_estimators.collective.api.numpy_ops import allgather_object, barrier, broadcast_object
from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.keras import callbacks, elastic
from spark_estimators.collective.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_variables,
)
from spark_estimators.collective.keras.optimizer import (
    Compression,
    Compressor,
    DistributedOptimizer,
    FP16Compressor,
    NoneCompressor,
    PartialDistributedOptimizer,
    is_distributed,
)
from spark_estimators.collective.runtime.process_sets import ProcessSet

is_distributed_optimizer = is_distributed

#: What the eager ops take: a tensor, a (Keras or TensorFlow) variable or a numpy array.
Value: TypeAlias = "tf.Tensor | tf.Variable | keras.Variable | np.ndarray"


def _to_numpy(value: Value) -> np.ndarray:
    return np.ascontiguousarray(keras.ops.convert_to_numpy(value))


def _like(result: np.ndarray, value: Value) -> tf.Tensor | np.ndarray:
    """Return numpy for numpy input, else a TensorFlow tensor."""
    if isinstance(value, np.ndarray):
        return result
    return tf.convert_to_tensor(result)


def allreduce(
    value: Value,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> tf.Tensor | np.ndarray:
    """Reduce a tensor (or numpy array, or variable) across ranks; eager mode.

    Parameters are Horovod's; ``op`` defaults to ``Average`` (``Adasum`` is accepted). Returns
    a tensor (numpy for numpy input). ``process_set`` restricts it to that set's members.
    """
    resolved = resolve_op(op, average, adasum=True)
    out = np.array(_to_numpy(value), copy=True)
    wire = compression.compress(out)  # ``out`` itself when not compressed
    _core.allreduce_(
        wire, resolved, name, prescale_factor, postscale_factor, process_set=process_set
    )
    compression.decompress(wire, out)
    return _like(out, value)


def allgather(
    value: Value, name: str | None = None, process_set: ProcessSet | None = None
) -> tf.Tensor | np.ndarray:
    """Concatenate every rank's tensor on the first dimension (which may differ)."""
    return _like(_core.allgather(_to_numpy(value), name, process_set), value)


def broadcast(
    value: Value, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> tf.Tensor | np.ndarray:
    """``root_rank``'s tensor on every rank (a global rank, also with ``process_set``)."""
    return _like(_core.broadcast(_to_numpy(value), root_rank, name, process_set), value)


def reducescatter(
    value: Value,
    op: ReduceOp | int | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> tf.Tensor | np.ndarray:
    """Reduce across ranks; rank r gets block r of the first dimension."""
    resolved = resolve_op(op, None)
    return _like(
        _core.reducescatter(_to_numpy(value), resolved, name, process_set=process_set), value
    )


def broadcast_global_variables(root_rank: int) -> None:
    """TF1 API of Horovod; with Keras 3 use :class:`BroadcastGlobalVariablesCallback`."""
    raise NotImplementedError(
        "broadcast_global_variables is TensorFlow 1 only: use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank)"
    )


def load_model(
    filepath: str,
    custom_optimizers: list[type] | None = None,
    custom_objects: dict[str, object] | None = None,
    compression: type[Compressor] = Compression.none,
) -> keras.Model:
    """Load a ``.keras`` model and wrap its optimizer in :func:`DistributedOptimizer`.

    Parameters
    ----------
    filepath
        A model saved with ``model.save(...)`` (with or without a distributed optimizer).
    custom_optimizers
        Optimizer classes not built into Keras (added to ``custom_objects`` by name).
    custom_objects
        Custom layers, losses, metrics... as for ``keras.saving.load_model``.
    compression
        Gradient compression of the wrapped optimizer.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = keras.saving.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
        model.make_train_function(force=True)
    return model


__all__ = [
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "NoneCompressor",
    "PartialDistributedOptimizer",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "is_distributed_optimizer",
    "load_model",
    "reducescatter",
]
__all__ += _api.__all__
