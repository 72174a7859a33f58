"""The TensorFlow adapter: ``import spark_estimators.collective.tensorflow as hvd``.

It replaces ``import horovod.tensorflow as hvd`` for TF2 training loops (custom loops with
``tf.GradientTape``, eagerly or inside ``tf.function``) run in :func:`spark_estimators.run`,
under ``python -m spark_estimators.launch -np N script.py`` or ``torchrun``:

* ``init``, ``rank``, ``size``, ``local_rank``, ... and process sets (shared with
  :mod:`spark_estimators.collective`), ``rank_op``/``size_op``/... as int32 tensors;
* ``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``,
  ``broadcast_``, ``alltoall``, ``reducescatter``, ``grouped_reducescatter``, ``join``,
  ``barrier`` on ``tf.Tensor`` / ``tf.Variable`` (``IndexedSlices`` for the allreduces),
  with ``op=Average|Sum|Min|Max|Product|Adasum``, ``process_set=``, ``compression=`` and
  horovod's gradients;
* :func:`DistributedGradientTape`, :func:`PartialDistributedGradientTape`,
  :func:`broadcast_variables`, :func:`broadcast_object`, :func:`allgather_object`,
  ``Compression``, ``elastic.TensorFlowKerasState`` / ``elastic.TensorFlowState``, and
  ``DistributedOptimizer`` for Keras 3 optimizers (that of
  :mod:`spark_estimators.collective.keras`).

How the ops reach the collective core (numpy buffers, ``tf.py_function`` inside
``tf.function``, the NCCL path through DLPack) is in
:mod:`spark_estimators.collective.tensorflow.util`. Inside ``tf.function`` compile without XLA
(``jit_compile=False``, the default): XLA cannot compile ``py_function``.

>>> import spark_estimators.collective.tensorflow as hvd
>>> hvd.init()  # doctest: +SKIP
>>> tape = hvd.DistributedGradientTape(tape)  # doctest: +SKIP
>>> hvd.broadcast_variables(model.variables, root_rank=0)  # doctest: +SKIP
"""

from __future__ import annotations

from spark_estimators.collective.requires import requires_extra

with requires_extra("spark_estimators.collective.tensorflow", "TensorFlow", "keras"):
    import tensorflow as _tf  # noqa: F401

from spark_estimators.collective import api as _api
from spark_estimators.collective.api import *  # noqa: F403
from spark_estimators.collective.tensorflow import elastic as elastic
from spark_estimators.collective.tensorflow import util as util
from spark_estimators.collective.tensorflow.compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)
from spark_estimators.collective.tensorflow.ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from spark_estimators.collective.tensorflow.optimizer import DistributedOptimizer
from spark_estimators.collective.tensorflow.tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from spark_estimators.collective.tensorflow.topology import (
    barrier,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from spark_estimators.collective.tensorflow.util import _executing_eagerly  # noqa: F401
from spark_estimators.errors import CollectiveError

#: Horovod's name for the error of a failed collective op.
HorovodInternalError = CollectiveError

__all__ = [
    "Compression",
    "Compressor",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "FP16Compressor",
    "HorovodInternalError",
    "NoneCompressor",
    "PartialDistributedGradientTape",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "size_op",
    "util",
]
__all__ += _api.__all__
