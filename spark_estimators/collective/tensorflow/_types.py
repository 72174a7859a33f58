"""The type names the TensorFlow adapter's signatures use.

TensorFlow ships no type information, so to mypy these names are as loose as ``Any``; they are
here for the reader: what an op takes and gives back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np
import tensorflow as tf

from spark_estimators.collective.runtime.process_sets import ProcessSet

if TYPE_CHECKING:
    import torch

#: A dense tensor or what ``tf.convert_to_tensor`` takes (a variable, a numpy array, a number).
TensorLike: TypeAlias = "tf.Tensor | tf.Variable | np.ndarray | float"
#: A gradient or reduced value: dense, sparse (``tf.IndexedSlices``) or absent.
Gradient: TypeAlias = "tf.Tensor | tf.IndexedSlices | None"
#: A ``tf.Variable`` or a Keras 3 variable (``model.variables``).
Variable: TypeAlias = "tf.Variable"
#: What a body of :func:`~spark_estimators.collective.tensorflow.util.run` gets and returns: a
#: numpy array (CPU), or a CUDA torch tensor under the nccl backend.
Array: TypeAlias = "np.ndarray | torch.Tensor"
#: ``body(*arrays) -> arrays``, run eagerly or in one ``tf.py_function``.
Body: TypeAlias = Callable[..., Sequence[Array]]
#: The gradient function a ``tf.custom_gradient`` forward returns.
Grad: TypeAlias = Callable[..., "tf.Tensor | list[tf.Tensor]"]
#: A process set argument: a registered set, or None for every rank.
ProcessSetArg: TypeAlias = "ProcessSet | None"

#: An object handed to every rank and returned as it was given (``broadcast_object``).
T = TypeVar("T")
#: How gradients are split into fused allreduces: a number of groups, lists of variables (one
#: fused allreduce each), or None (one group).
Groups: TypeAlias = "int | Sequence[Sequence[tf.Variable]] | None"
#: A ``tf.nest`` structure of gradients (what ``GradientTape.gradient`` returns).
Nest: TypeAlias = "Gradient | Sequence[Nest] | Mapping[str, Nest]"
