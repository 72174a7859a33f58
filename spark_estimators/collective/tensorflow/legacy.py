"""``DistributedOptimizer`` for TF1 ``tf.compat.v1.train.Optimizer`` in graph mode (horovod's).

``compute_gradients`` averages the wrapped optimizer's gradients across ranks (the reducer of
:func:`~spark_estimators.collective.tensorflow.DistributedGradientTape`: one fused
``grouped_allreduce``); ``apply_gradients`` and the rest delegate to it. Local gradient
aggregation (``backward_passes_per_step > 1``) and the Adasum delta optimizer of horovod's TF1
API are not implemented (refused). Keras 3 optimizers go to
:func:`spark_estimators.collective.keras.DistributedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import tensorflow as tf

from spark_estimators.collective.backends.base import ReduceOp
from spark_estimators.collective.tensorflow._types import Gradient, Variable
from spark_estimators.collective.tensorflow.tape import _Reducer, _ref
from spark_estimators.errors import ConfigurationError


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a TF1 optimizer; gradients are averaged in ``compute_gradients``."""

    def __init__(
        self,
        optimizer: tf.compat.v1.train.Optimizer,
        name: str | None,
        use_locking: bool,
        reducer: _Reducer,
        scale_local_gradients: bool,
    ):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)  # fmt: skip
        self._optimizer = optimizer
        self._reducer = reducer
        self._local_vars: set[Hashable] = set()
        self.process_set = reducer.process_set
        self.scale_local_gradients = scale_local_gradients

    def register_local_var(self, var: Variable) -> None:
        """Keep ``var``'s gradient local (no allreduce)."""
        self._local_vars.add(_ref(var))

    def compute_gradients(self, *args: object, **kwargs: object) -> list[tuple[Gradient, Variable]]:
        """The wrapped optimizer's gradients, averaged across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [list(t) for t in zip(*pairs, strict=True)] if pairs else ([], [])
        grads = self._reducer.reduce_shared(
            grads, variables, self._local_vars, self.scale_local_gradients
        )
        return list(zip(grads, variables, strict=True))

    def apply_gradients(
        self,
        grads_and_vars: Sequence[tuple[Gradient, Variable]],
        global_step: tf.Variable | None = None,
        name: str | None = None,
    ) -> tf.Operation:
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: object, **kwargs: object) -> tf.Variable | None:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: object, **kwargs: object) -> list[str]:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: object, **kwargs: object) -> list[tf.Variable]:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def legacy_distributed_optimizer(
    optimizer: tf.compat.v1.train.Optimizer,
    name: str | None,
    use_locking: bool,
    reducer: _Reducer,
    backward_passes_per_step: int = 1,
    scale_local_gradients: bool = True,
) -> _DistributedOptimizer:
    """Wrap a ``tf.compat.v1.train.Optimizer`` whose gradients ``reducer`` averages.

    ``reducer`` holds the options of horovod's ``DistributedOptimizer`` that say how gradients
    are reduced (compression, op, groups, process set, ...), as for ``DistributedGradientTape``.
    """
    if reducer.op is ReduceOp.ADASUM or backward_passes_per_step != 1:
        raise ConfigurationError(
            "the TF1 DistributedOptimizer supports neither op=Adasum nor "
            f"backward_passes_per_step={backward_passes_per_step!r} > 1 here; use "
            "hvd.DistributedGradientTape in a TF2 loop (accumulate gradients yourself)"
        )
    return _DistributedOptimizer(optimizer, name, use_locking, reducer, scale_local_gradients)
