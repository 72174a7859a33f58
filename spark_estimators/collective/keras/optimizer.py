"""``DistributedOptimizer`` for Keras 3 on TensorFlow: average gradients inside ``model.fit``.

Design (see DECISIONS.md, "Keras"): Keras 3 ``fit`` under ``MultiWorkerMirroredStrategy`` is
broken upstream and ``tf_keras`` is not in our stack, so distribution happens in the one place
every Keras training path goes through: ``Optimizer.apply(grads, trainable_variables)``.
``apply_gradients`` calls it, the compiled train step calls it (also with
``steps_per_execution > 1``), and so do custom training loops. :func:`DistributedOptimizer`
builds, at run time, a subclass of the user's optimizer class that overrides only ``apply``:

1. gradients of one dtype are flattened and concatenated into one tensor (``None`` gradients
   pass through; ``IndexedSlices`` from embeddings become dense);
2. one ``tf.py_function`` (a single call, so every rank issues its collectives in the same
   order whatever order TensorFlow schedules ops in) copies each flat tensor into a 64-byte
   aligned numpy buffer, allreduces it **in place** through :mod:`spark_estimators.collective`
   (gloo over torch.distributed, or MPI) and divides by ``size()``;
3. the buffer goes back to TensorFlow zero-copy through DLPack (TensorFlow aborts on unaligned
   DLPack memory, hence the alignment), is split and reshaped (0-d variables stay 0-d);
4. the base class's ``apply`` runs unchanged: clipping, weight decay, loss-scale checks, EMA,
   constraints and the iteration counter behave exactly as in a single process.

Everything else about Keras stays real: compile-time metrics, callbacks, ``History``,
``steps_per_execution``. The subclass keeps the base class's name and module, so a model saved
with it (``model.save("m.keras")``) loads back with the plain optimizer.

Constraints: compile with ``jit_compile=False`` (XLA cannot compile ``py_function``; Keras turns
XLA on by itself when a GPU is visible). With mixed precision wrap as
``DistributedOptimizer(LossScaleOptimizer(opt))`` (done automatically under a
``mixed_float16`` policy): the finite-gradient check must see the averaged gradients, or ranks
disagree about skipping a step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators import collective as _core
from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime.arrays import aligned_empty
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.errors import CollectiveError, ConfigurationError

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


class Compressor:
    """Compresses a numpy buffer for the wire and restores it (Horovod's interface)."""

    @staticmethod
    def compress(buf: np.ndarray) -> np.ndarray:
        """Return ``buf`` unchanged."""
        return buf

    @staticmethod
    def decompress(wire: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Return ``out`` (the reduction already wrote it in place)."""
        return out


class NoneCompressor(Compressor):
    """No compression: the buffer is reduced as it is."""


class FP16Compressor(Compressor):
    """Floating buffers travel as float16 (half the bytes), restored to their dtype after."""

    @staticmethod
    def compress(buf: np.ndarray) -> np.ndarray:
        """Return ``buf`` as float16 when it is a floating buffer."""
        if buf.dtype.kind == "f" and buf.dtype != np.float16:
            return buf.astype(np.float16)
        return buf

    @staticmethod
    def decompress(wire: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy ``wire`` back into ``out``'s dtype and return ``out``."""
        if wire is not out:
            np.copyto(out, wire, casting="unsafe")
        return out


class Compression:
    """``Compression.none`` / ``Compression.fp16``, as in ``horovod.tensorflow.keras``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def allreduce_numpy_buffers(
    buffers: Sequence[np.ndarray],
    op: ReduceOp,
    name: str,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: type[Compressor] = NoneCompressor,
    process_set: ProcessSet | None = None,
) -> None:
    """Allreduce writable buffers in place, one collective per buffer, in list order."""
    handles = []
    for i, buf in enumerate(buffers):
        wire = compression.compress(buf)
        handle = _core.allreduce_async_(
            wire,
            op=op,
            name=f"{name}.{i}",
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
        handles.append((handle, wire, buf))
    for handle, wire, buf in handles:
        handle.wait()
        compression.decompress(wire, buf)


class _Reducer:
    """The eager body of the ``py_function``: numpy in, averaged DLPack-backed tensors out."""

    def __init__(
        self,
        op: ReduceOp,
        name: str,
        prescale: float,
        postscale: float,
        compression: type[Compressor],
        process_set: ProcessSet | None = None,
    ):
        self.op, self.name = op, name
        self.prescale, self.postscale = prescale, postscale
        self.compression = compression
        self.process_set = process_set

    def __call__(self, *flats: tf.Tensor) -> list[tf.Tensor]:
        import tensorflow as tf

        buffers = []
        for flat in flats:
            src = flat.numpy()
            buf = aligned_empty(src.size, src.dtype)
            np.copyto(buf, src.reshape(-1))
            buffers.append(buf)
        allreduce_numpy_buffers(
            buffers, self.op, self.name, self.prescale, self.postscale, self.compression,
            self.process_set,
        )  # fmt: skip
        # Zero-copy: the DLPack capsule keeps the numpy buffer alive as long as the tensor.
        return [tf.experimental.dlpack.from_dlpack(buf.__dlpack__()) for buf in buffers]


def allreduce_gradients(
    grads: Sequence[tf.Tensor | None], reducer: _Reducer
) -> list[tf.Tensor | None]:
    """Average ``grads`` (tensors or ``None``) across ranks with one fused buffer per dtype."""
    import tensorflow as tf

    dense: list[tf.Tensor | None] = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    present = {i: g for i, g in enumerate(dense) if g is not None}
    groups: dict[str, list[int]] = {}
    for i, g in present.items():
        groups.setdefault(g.dtype.name, []).append(i)
    if not groups:
        return dense
    order = sorted(groups)  # the same on every rank
    flats = [tf.concat([tf.reshape(present[i], [-1]) for i in groups[d]], axis=0) for d in order]
    reduced = tf.py_function(reducer, inp=flats, Tout=[f.dtype for f in flats])
    out = list(dense)
    for dtype_name, flat, red in zip(order, flats, reduced, strict=True):
        red.set_shape(flat.shape)
        idx = groups[dtype_name]
        sizes = [int(np.prod(present[i].shape.as_list(), dtype=np.int64)) for i in idx]
        pieces = tf.split(red, sizes) if len(idx) > 1 else [red]
        for i, piece in zip(idx, pieces, strict=True):
            out[i] = tf.reshape(piece, tf.shape(present[i]))
    return out


def _reduces(process_set: ProcessSet | None) -> bool:
    """Whether ``apply`` averages the gradients across ranks.

    As in horovod, a rank outside the optimizer's process set, or a set (or job) of one rank,
    applies its own gradients unchanged.
    """
    if not _core.is_initialized():
        return False
    if process_set is None:
        return _core.size() > 1
    return bool(process_set.included()) and int(process_set.size() or 0) > 1


class _DistributedMixin:
    """Overrides ``apply``; every other method is the user's optimizer class's own."""

    _se_reducer: _Reducer | None = None
    #: ids of the variables whose gradients stay local (PartialDistributedOptimizer).
    _se_local_ids: frozenset[int] = frozenset()
    _se_scale_local: bool = True

    def apply(
        self,
        grads: Sequence[tf.Tensor | None],
        trainable_variables: Sequence[keras.Variable] | None = None,
    ) -> object:
        reducer = self._se_reducer
        if reducer is not None and _reduces(reducer.process_set):
            if self._se_local_ids:
                grads = self._se_partial(list(grads), trainable_variables, reducer)
            else:
                grads = allreduce_gradients(list(grads), reducer)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def _se_partial(
        self,
        grads: list[tf.Tensor | None],
        trainable_variables: Sequence[keras.Variable] | None,
        reducer: _Reducer,
    ) -> list[tf.Tensor | None]:
        """Average the shared variables' gradients; the local ones stay (scaled by 1/size)."""
        variables = list(
            trainable_variables if trainable_variables is not None else self._trainable_variables  # type: ignore[attr-defined]
        )
        local = [id(v) in self._se_local_ids for v in variables]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = allreduce_gradients([grads[i] for i in shared], reducer)
        for i, g in zip(shared, reduced, strict=True):
            grads[i] = g
        if self._se_scale_local:
            ps = reducer.process_set
            scale = 1.0 / (_core.size() if ps is None else int(ps.size() or 1))
            for i, is_local in enumerate(local):
                g = grads[i]
                if is_local and g is not None:
                    grads[i] = g * scale
        return grads


def distributed_class(base: type) -> type:
    """The cached run-time subclass of ``base`` that averages gradients in ``apply``.

    It keeps ``base``'s ``__name__``, ``__qualname__`` and ``__module__``, so Keras serializes
    an instance as the plain ``base`` (a saved model reloads with the ordinary optimizer).
    """
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = type(base.__name__, (_DistributedMixin, base), {})
            cls.__qualname__ = base.__qualname__
            cls.__module__ = base.__module__
            _CLASSES[base] = cls
        return cls


def is_distributed(optimizer: object) -> bool:
    """True for an optimizer returned by :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _DistributedMixin)


def _clone_as(
    optimizer: keras.optimizers.Optimizer, cls: type[keras.optimizers.Optimizer]
) -> keras.optimizers.Optimizer:
    """A new ``cls`` instance configured (and, if built, with the state) of ``optimizer``."""
    config = optimizer.get_config()
    # Objects are passed as they are, so custom schedules and wrapped optimizers need no
    # registration or custom_objects to round-trip through the config.
    lr = getattr(optimizer, "_learning_rate", None)
    if lr is not None and "learning_rate" in config and not hasattr(lr, "assign"):
        config["learning_rate"] = lr
    if "inner_optimizer" in config and hasattr(optimizer, "inner_optimizer"):
        # LossScaleOptimizer: its from_config would deserialize the inner optimizer again.
        config.pop("inner_optimizer")
        clone = cls(optimizer.inner_optimizer, **config)
    else:
        clone = cls.from_config(config)
    if getattr(optimizer, "built", False):
        clone.build(list(optimizer._trainable_variables))
        for mine, theirs in zip(clone.variables, optimizer.variables, strict=True):
            mine.assign(theirs)
    return clone


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp | int | None = None,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[keras.Variable]] | None = None,
    process_set: ProcessSet | None = None,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras optimizer so every ``apply`` averages the gradients across ranks.

    Parameters
    ----------
    optimizer
        A ``keras.optimizers.Optimizer`` (Keras 3, TensorFlow backend). The result is a new
        optimizer of a run-time subclass of its class, with the same config and state.
    name
        Prefix of the collective ops' names (for error messages).
    device_dense, device_sparse, sparse_as_dense, num_groups, groups
        Accepted for ``horovod.tensorflow.keras`` compatibility; gradients are always fused
        into one buffer per dtype and sparse gradients are always made dense.
    compression
        ``Compression.none`` (default) or ``Compression.fp16``.
    gradient_predivide_factor
        Divide by this before the sum and by ``size() / factor`` after (Horovod's meaning).
    op
        ``Average`` (default) or ``Sum``.
    process_set
        Average among this ``ProcessSet``'s members only (default: every rank). On a rank
        outside the set the optimizer applies the rank's own gradients, as horovod's does.
    backward_passes_per_step, average_aggregated_gradients
        Only ``1`` is supported: for local accumulation give the Keras optimizer
        ``gradient_accumulation_steps=k``; each micro-batch's gradients are then averaged across
        ranks and Keras averages the k of them, which equals one k-times larger batch.

    Returns
    -------
    keras.optimizers.Optimizer
        Pass it to ``model.compile(optimizer=..., jit_compile=False)``.

    Raises
    ------
    ConfigurationError
        Not a Keras 3 optimizer, another Keras backend, ``op=Adasum``, or
        ``backward_passes_per_step != 1``.

    Examples
    --------
    >>> import keras
    >>> import spark_estimators.collective.keras as hvd
    >>> hvd.init()  # doctest: +SKIP
    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))  # doctest: +SKIP
    >>> model.compile(optimizer=opt, loss="mse", jit_compile=False)  # doctest: +SKIP
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ConfigurationError(
            f"spark_estimators.collective.keras needs the TensorFlow Keras backend, got "
            f"KERAS_BACKEND={keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow"
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigurationError(
            f"DistributedOptimizer needs a keras.optimizers.Optimizer instance, got "
            f"{type(optimizer).__name__}; e.g. DistributedOptimizer(keras.optimizers.Adam(1e-3))"
        )
    if backward_passes_per_step != 1:
        raise ConfigurationError(
            f"backward_passes_per_step={backward_passes_per_step!r} is not supported by the Keras "
            "adapter; give the Keras optimizer gradient_accumulation_steps="
            f"{backward_passes_per_step} instead (same effective batch)"
        )
    resolved = resolve_op(op, None)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ConfigurationError(f"op={resolved.name} is not supported: use Average or Sum")
    if process_set is not None:
        from spark_estimators.collective.runtime import engine as _engine

        if process_set.included() is not False:  # a non-member applies its own gradients
            _engine.require("DistributedOptimizer", process_set)  # registered, after init()
    if gradient_predivide_factor != 1.0 and resolved is not ReduceOp.AVERAGE:
        raise ConfigurationError("gradient_predivide_factor needs op=Average")
    if is_distributed(optimizer):
        raise ConfigurationError("the optimizer is already a DistributedOptimizer")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and is_distributed(
        optimizer.inner_optimizer
    ):
        raise ConfigurationError(
            "LossScaleOptimizer(DistributedOptimizer(opt)) lets ranks disagree about skipping a "
            "step: wrap as DistributedOptimizer(LossScaleOptimizer(opt))"
        )
    policy = keras.config.dtype_policy()
    if policy.name == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        # compile() would wrap it the other way round; see the module docstring.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if resolved is ReduceOp.AVERAGE and gradient_predivide_factor != 1.0:
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    else:
        prescale = postscale = 1.0
    dist = _clone_as(optimizer, distributed_class(type(optimizer)))
    dist._se_reducer = _Reducer(
        resolved,
        name or f"{type(optimizer).__name__}.gradients",
        prescale,
        postscale,
        compression,
        process_set,
    )
    return dist


def check_initialized(what: str) -> None:
    """Raise :class:`~spark_estimators.errors.CollectiveError` naming ``what`` before ``init()``."""
    if not _core.is_initialized():
        raise CollectiveError(
            f"{what} needs the collective group: call spark_estimators.collective.keras.init() "
            "first"
        )


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp | int | None = None,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: int | Sequence[Sequence[keras.Variable]] | None = None,
    process_set: ProcessSet | None = None,
    scale_local_gradients: bool = True,
    local_layers: keras.layers.Layer | Sequence[keras.layers.Layer] | None = None,
) -> keras.optimizers.Optimizer:
    """A :func:`DistributedOptimizer` that leaves the gradients of ``local_layers`` local.

    The trainable variables of ``local_layers`` (a layer or a list of layers) are updated from
    this rank's own gradients, every other variable from the average across ranks (horovod's
    ``PartialDistributedOptimizer``). ``scale_local_gradients`` (default, as horovod): a local
    gradient is divided by the number of ranks, so that a rank's local and shared updates keep
    the same scale. Other parameters: as :func:`DistributedOptimizer`.

    Examples
    --------
    >>> opt = hvd.PartialDistributedOptimizer(  # doctest: +SKIP
    ...     keras.optimizers.SGD(0.01), local_layers=[model.get_layer("rank_head")]
    ... )
    """
    if local_layers is None:
        layers: list[keras.layers.Layer] = []
    elif isinstance(local_layers, list | tuple):
        layers = list(local_layers)
    else:
        layers = [local_layers]
    dist = DistributedOptimizer(
        optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
    )
    local_ids = frozenset(id(v) for layer in layers for v in layer.trainable_weights)
    if layers and not local_ids:
        raise ConfigurationError(
            "local_layers have no trainable weights yet: build the model (call it once, or give "
            "it an Input) before making the PartialDistributedOptimizer"
        )
    dist._se_local_ids = local_ids
    dist._se_scale_local = scale_local_gradients
    return dist
