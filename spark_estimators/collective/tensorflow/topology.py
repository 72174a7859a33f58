"""``join``, ``barrier`` and horovod's topology ops (``rank_op``, ``size_op``, ...) as tensors."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from spark_estimators import collective as _core
from spark_estimators.collective.runtime import process_sets
from spark_estimators.collective.runtime.process_sets import ProcessSet, global_process_set
from spark_estimators.collective.tensorflow import util
from spark_estimators.collective.tensorflow.util import run


def join() -> tf.Tensor:
    """Declare this rank done; returns the last rank that joined (an int32 scalar tensor)."""
    (out,) = run(lambda: [np.asarray(_core.join(), dtype=np.int32)], [], [tf.int32], [[]])
    return out


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Block until every rank (of ``process_set``) has called ``barrier()``."""
    _core.barrier(util.resolve_process_set(process_set))


def _int_op(value: int, name: str | None) -> tf.Tensor:
    return tf.constant(value, dtype=tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """``size()`` of a process set (by id) as an int32 tensor."""
    return _int_op(util.process_set_size(_set_by_id(process_set_id)), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to the process set ``process_set_id``, else 0 (int32)."""
    return _int_op(int(bool(_set_by_id(process_set_id).included())), name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """``rank()`` as an int32 tensor."""
    return _int_op(_core.rank(), name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """``local_rank()`` as an int32 tensor."""
    return _int_op(_core.local_rank(), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """``local_size()`` as an int32 tensor."""
    return _int_op(_core.local_size(), name)


def _set_by_id(process_set_id: int) -> ProcessSet:
    if process_set_id == 0:
        return global_process_set
    for ps in process_sets.registered():
        if ps.process_set_id == process_set_id:
            return ps
    raise ValueError(f"process_set_id={process_set_id!r} is not a registered process set")
