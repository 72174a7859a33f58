"""``DistributedOptimizer`` of ``horovod.tensorflow``: a Keras 3 optimizer or a TF1 one, wrapped.

Keras 3 optimizers go to :func:`spark_estimators.collective.keras.DistributedOptimizer` (averaging
in ``apply``); TF1 ``tf.compat.v1.train.Optimizer`` objects to the graph-mode wrapper of
:mod:`~spark_estimators.collective.tensorflow.legacy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime.process_sets import global_process_set
from spark_estimators.collective.tensorflow import util
from spark_estimators.collective.tensorflow._types import Groups, ProcessSetArg
from spark_estimators.collective.tensorflow.compression import (
    Compression,
    Compressor,
    FP16Compressor,
)
from spark_estimators.collective.tensorflow.legacy import legacy_distributed_optimizer
from spark_estimators.collective.tensorflow.tape import _Reducer
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import keras

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(  # noqa: N802 - horovod's name
    optimizer: keras.optimizers.Optimizer | tf.compat.v1.train.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: ReduceOp | int | None = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSetArg = global_process_set,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer | tf.compat.v1.train.Optimizer:
    """Wrap an optimizer so its gradients are averaged across ranks (horovod's signature).

    A Keras 3 optimizer becomes :func:`spark_estimators.collective.keras.DistributedOptimizer`
    (averaging in ``apply``, as horovod delegates to ``horovod.tensorflow.keras``); a TF1
    ``tf.compat.v1.train.Optimizer`` is wrapped for graph mode
    (:mod:`~spark_estimators.collective.tensorflow.legacy`).
    """
    import keras

    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = _Reducer(
            compression, sparse_as_dense, resolve_op(op, None, adasum=True),
            gradient_predivide_factor, groups or num_groups or None, process_set,
        )  # fmt: skip
        return legacy_distributed_optimizer(
            optimizer, name, use_locking, reducer, backward_passes_per_step, scale_local_gradients
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigurationError(
            f"DistributedOptimizer takes a Keras 3 or a tf.compat.v1.train optimizer, got "
            f"{type(optimizer).__name__}"
        )
    from spark_estimators.collective import keras as hvd_keras

    # The Keras optimizer compresses its numpy buffer: take its fp16 for ours.
    fp16 = issubclass(compression, FP16Compressor) or compression is hvd_keras.Compression.fp16
    return hvd_keras.DistributedOptimizer(
        optimizer,
        name=name,
        compression=hvd_keras.Compression.fp16 if fp16 else hvd_keras.Compression.none,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        process_set=None if util.resolve_process_set(process_set) is None else process_set,
    )  # fmt: skip
