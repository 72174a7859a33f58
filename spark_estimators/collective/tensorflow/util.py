"""The bridge between TensorFlow tensors and the collective core (``horovod.tensorflow.util``).

Every op of :mod:`spark_estimators.collective.tensorflow` runs a Python function over arrays:

* **eagerly** (``tf.executing_eagerly()``): the tensors become numpy arrays, the function runs
  in the caller's thread and its results come back as tensors - no ``py_function``;
* **inside** ``tf.function`` (or a TF1 graph): the same function runs in one
  ``tf.py_function``. ``py_function`` is stateful, so ``tf.function``'s automatic control
  dependencies keep the collectives in program order on every rank (the engine negotiates ops
  in submission order). A TF1 graph has no such dependencies: each collective gets a control
  dependency on the one created before it in the graph (a ``session.run`` of a later one
  runs the earlier ones again, on every rank alike).

Arrays are numpy for CPU tensors (the core ops of :mod:`spark_estimators.collective`, Gloo or
MPI). Under the ``nccl`` backend, GPU tensors travel to torch through DLPack and use the torch
adapter's ops (NCCL) - written, **not tested on a GPU**. Results come back zero-copy through
DLPack from 64-byte aligned buffers (TensorFlow aborts on unaligned DLPack memory), or copied.

Errors keep TensorFlow's types: a collective that failed across ranks (mismatched shapes or
dtypes, a dead peer) raises :class:`CollectiveFailedError` (a
``tf.errors.FailedPreconditionError`` and a :class:`~spark_estimators.errors.CollectiveError`),
bad arguments :class:`InvalidCollectiveArgument` (a ``tf.errors.InvalidArgumentError`` and a
:class:`~spark_estimators.errors.ConfigurationError`), as horovod's TensorFlow ops do.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import tensorflow as tf

from spark_estimators.collective.runtime.arrays import ALIGNMENT, aligned_empty
from spark_estimators.collective.tensorflow._types import Array, Body, ProcessSetArg, TensorLike
from spark_estimators.errors import CollectiveError, ConfigurationError

#: The last collective op created in each TF1 graph (see :func:`run`).
_LAST_OP: weakref.WeakKeyDictionary[tf.Graph, tf.Operation] = weakref.WeakKeyDictionary()


class CollectiveFailedError(tf.errors.FailedPreconditionError, CollectiveError):
    """A collective op failed across ranks (horovod's ``FailedPreconditionError``)."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[type[CollectiveFailedError], tuple[str]]:
        return (type(self), (self.message,))


class InvalidCollectiveArgument(tf.errors.InvalidArgumentError, ConfigurationError):  # noqa: N818
    """Bad arguments to a collective op (horovod's ``InvalidArgumentError``)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[type[InvalidCollectiveArgument], tuple[str]]:
        return (type(self), (self.message,))


def _executing_eagerly() -> bool:
    """Horovod's helper: True in eager mode (TF2 outside ``tf.function``)."""
    return bool(tf.executing_eagerly())


def translate(exc: BaseException) -> BaseException:
    """The TensorFlow-typed error for a core error (other errors unchanged)."""
    if isinstance(exc, (CollectiveFailedError, InvalidCollectiveArgument)):
        return exc
    if isinstance(exc, ConfigurationError):
        return InvalidCollectiveArgument(str(exc))
    if isinstance(exc, CollectiveError):
        return CollectiveFailedError(str(exc))
    return exc


def _use_torch(tensor: TensorLike) -> bool:
    """True for a GPU tensor under the nccl backend (NCCL path through torch)."""
    if "GPU" not in (getattr(tensor, "device", "") or "").upper():
        return False
    from spark_estimators.collective.runtime import engine

    current = engine.current()
    return current is not None and current.backend.name == "nccl"


def to_array(tensor: tf.Tensor | np.ndarray) -> Array:
    """A numpy array (CPU) or, under nccl, a CUDA torch tensor sharing the GPU memory."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if _use_torch(tensor):  # pragma: no cover - needs a GPU
        import torch

        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    try:
        return np.from_dlpack(tensor)  # zero-copy, read-only (the ops copy what they write)
    except (TypeError, RuntimeError, BufferError, ValueError, AttributeError):
        return np.asarray(tensor.numpy())  # e.g. dtypes DLPack does not carry


def to_tensor(array: Array) -> tf.Tensor:
    """A tensor of ``array`` (zero-copy for aligned contiguous numpy, DLPack for torch)."""
    if not isinstance(array, np.ndarray):  # pragma: no cover - torch CUDA result (nccl)
        import torch.utils.dlpack

        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(array.contiguous()))
    if (
        array.size >= 4096
        and array.flags.c_contiguous
        and array.ctypes.data % ALIGNMENT == 0
        and array.dtype.kind in "fiub"
        and array.dtype != np.float16  # DLPack import of float16/bool varies by version
        and array.dtype != np.bool_
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A writable, 64-byte aligned, C-contiguous copy of ``array`` (same shape)."""
    out = aligned_empty(array.size, array.dtype).reshape(array.shape)
    np.copyto(out, array)
    return out


def core_for(arrays: Sequence[Array]) -> ModuleType:
    """The module whose ops take these arrays: the numpy core, or the torch adapter (nccl)."""
    if arrays and not isinstance(arrays[0], np.ndarray):  # pragma: no cover - needs a GPU
        import spark_estimators.collective.torch as torch_ops

        return torch_ops
    import spark_estimators.collective as core

    return core


def run(
    body: Body,
    inputs: Sequence[TensorLike],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[tf.TensorShape | None] | None = None,
) -> list[tf.Tensor]:
    """Run ``body(*arrays) -> arrays`` eagerly, or in one ``tf.py_function`` in a graph."""
    tensors = [tf.convert_to_tensor(x) for x in inputs]

    def eager(*values: tf.Tensor) -> list[tf.Tensor]:
        arrays = [to_array(v) for v in values]
        try:
            results = body(*arrays)
        except Exception as exc:  # noqa: BLE001 - re-raised with TensorFlow's error type
            raise translate(exc) from exc
        return [to_tensor(r) for r in results]

    if tf.executing_eagerly():
        return eager(*tensors)
    if tf.inside_function():  # tf.function: automatic control dependencies keep the order
        outs = tf.py_function(eager, inp=tensors, Tout=list(out_dtypes))
    else:
        # A TF1 graph has none: chain the collectives in creation order, as every rank creates
        # them, or one session.run could start them in a different order on each rank.
        graph = tf.compat.v1.get_default_graph()
        last = _LAST_OP.get(graph)
        with tf.control_dependencies([last] if last is not None else []):
            outs = tf.py_function(eager, inp=tensors, Tout=list(out_dtypes))
        first = outs[0] if isinstance(outs, (list, tuple)) else outs
        _LAST_OP[graph] = first.op
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for out, shape in zip(outs, out_shapes or [None] * len(outs), strict=True):
        if shape is not None:
            out.set_shape(shape)
    return outs


def resolve_process_set(process_set: ProcessSetArg) -> ProcessSetArg:
    """``None`` for the global set (what the core takes), else the set itself."""
    from spark_estimators.collective.runtime.process_sets import is_global

    return None if process_set is None or is_global(process_set) else process_set


def process_set_size(process_set: ProcessSetArg) -> int:
    """The number of ranks of ``process_set`` (``size()`` for the global set)."""
    from spark_estimators import collective

    ps = resolve_process_set(process_set)
    if ps is None:
        return collective.size()
    size = ps.size()
    if size is None:
        raise InvalidCollectiveArgument(
            f"{ps!r} is not registered: register it on every rank with hvd.add_process_set(...)"
        )
    return size


__all__ = [
    "CollectiveFailedError",
    "InvalidCollectiveArgument",
    "_executing_eagerly",
    "aligned_copy",
    "aligned_empty",
    "core_for",
    "process_set_size",
    "resolve_process_set",
    "run",
    "to_array",
    "to_tensor",
    "translate",
]
