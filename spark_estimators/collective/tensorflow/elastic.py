"""``hvd.elastic`` for TensorFlow: :class:`TensorFlowKerasState`, :class:`TensorFlowState`.

Exposed as ``spark_estimators.collective.tensorflow.elastic`` (horovod's
``horovod.tensorflow.elastic``) and used as the torch one
(:mod:`spark_estimators.collective.torch.elastic`): decorate the training function with
``hvd.elastic.run`` and pass it a state such as
``hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)``.

``save()`` copies the variables' values (numpy), ``restore()`` assigns them back, ``sync()``
broadcasts rank 0's variables (one broadcast per dtype) and attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators.collective import common_elastic as _common
from spark_estimators.collective.common_elastic import *  # noqa: F403
from spark_estimators.collective.common_elastic import FrameworkState

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

    from spark_estimators.collective.api.elastic import BroadcastObject


class TensorFlowState(FrameworkState):
    """Elastic state of a list of TensorFlow (or Keras) variables plus picklable attributes.

    Parameters
    ----------
    variables
        The variables saved on commit and broadcast from rank 0 on sync (same order on every
        rank). Default: ``tf.compat.v1.global_variables()`` (empty in TF2 eager code).
    **kwargs
        Other attributes (``epoch``, ``batch``), handled as by :class:`ObjectState`.
    """

    def __init__(
        self,
        variables: Sequence[tf.Variable] | None = None,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        if variables is None:
            import tensorflow as tf

            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self._saved_values: list[np.ndarray] = []
        super().__init__(bcast_object, get_rank, **kwargs)

    def _all_variables(self) -> list[tf.Variable]:
        return self.variables

    def _save_objects(self) -> None:
        """Copy the variables' values (numpy)."""
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._all_variables()]

    def _restore_objects(self) -> None:
        """Assign the saved values back."""
        variables = self._all_variables()
        if len(variables) == len(self._saved_values):
            for v, value in zip(variables, self._saved_values, strict=True):
                v.assign(value)

    def _broadcast_objects(self) -> None:
        """Broadcast rank 0's variables (one broadcast per dtype)."""
        from spark_estimators.collective.tensorflow.tape import broadcast_variables

        variables = self._all_variables()
        if variables:
            broadcast_variables(variables, root_rank=0)


class TensorFlowKerasState(TensorFlowState):
    """Elastic state of a Keras model and optimizer (their variables) plus attributes.

    Parameters
    ----------
    model
        A Keras model; ``model.variables`` are saved and synced.
    optimizer
        A Keras optimizer (default ``model.optimizer``); its ``variables`` too, once built (a
        new worker's unbuilt optimizer is built on the model's trainable variables first).
    **kwargs
        Other attributes, handled as by :class:`ObjectState`.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        bcast_object: BroadcastObject | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: object,
    ) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__([], bcast_object, get_rank, **kwargs)

    def _all_variables(self) -> list[tf.Variable]:
        variables = list(self.model.variables)
        opt = self.optimizer
        if opt is not None:
            if not getattr(opt, "built", True) and self.model.trainable_variables:
                opt.build(self.model.trainable_variables)
            variables += list(opt.variables)
        return variables


__all__ = ["TensorFlowKerasState", "TensorFlowState", *_common.__all__]
