"""``DistributedGradientTape``, ``broadcast_variables`` and the object helpers for TF2 loops.

:func:`DistributedGradientTape` wraps a finished ``tf.GradientTape`` (horovod's way: a run-time
subclass of the tape's class that shares its recording) whose ``gradient()`` averages the
gradients across ranks:

* dense gradients go through **one** ``grouped_allreduce`` - one ``tf.py_function`` inside
  ``tf.function``, one fusion buffer per dtype in the core engine (the same fused path as the
  torch adapter's ``grouped_allreduce``);
* ``tf.IndexedSlices`` (embedding gradients) are allgathered (values and indices) as in
  horovod, or made dense first with ``sparse_as_dense=True``;
* gradients of sources registered with ``register_local_source`` (and the layers given to
  :func:`PartialDistributedGradientTape`) stay local, divided by ``size()`` when
  ``scale_local_gradients`` (horovod's default).

A rank outside ``process_set`` gets its own gradients back (it trains locally, as horovod).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import tensorflow as tf

from spark_estimators import collective as _core
from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime.process_sets import global_process_set
from spark_estimators.collective.tensorflow import ops, util
from spark_estimators.collective.tensorflow._types import (
    Gradient,
    Groups,
    Nest,
    ProcessSetArg,
    T,
    Variable,
)
from spark_estimators.collective.tensorflow.compression import (
    Compression,
    Compressor,
)
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import keras


def _dtype(v: Variable) -> tf.DType:
    return tf.as_dtype(getattr(v.dtype, "base_dtype", v.dtype))


def _ref(v: Variable) -> Hashable:
    """A hashable key of a variable: ``tf.Variable.ref()``; a Keras 3 variable has no ``ref``."""
    if hasattr(v, "ref"):
        return v.ref()
    inner = getattr(v, "value", None)
    return inner.ref() if inner is not None and hasattr(inner, "ref") else id(v)


def _value(v: Variable) -> tf.Tensor:
    return tf.convert_to_tensor(v)


def broadcast_variables(
    variables: Sequence[Variable],
    root_rank: int,
    process_set: ProcessSetArg = global_process_set,
    inplace: bool = False,
) -> tf.Operation | None:
    """Overwrite ``variables`` with ``root_rank``'s values: one broadcast per dtype.

    Works eagerly and inside ``tf.function``; takes ``tf.Variable`` and Keras 3 variables
    (``model.variables``, ``optimizer.variables``), in the same order on every rank.
    ``inplace`` is accepted for horovod compatibility.
    """
    variables = [v for v in variables if v is not None]
    if not variables:
        return None
    groups: dict[str, list[Variable]] = {}
    for v in variables:
        groups.setdefault(_dtype(v).name, []).append(v)
    assigns = []
    for dtype_name in sorted(groups):
        vs = groups[dtype_name]
        flat = tf.concat([tf.reshape(_value(v), [-1]) for v in vs], axis=0)
        flat = ops.broadcast(flat, root_rank, name=f"broadcast_variables.{dtype_name}",
                             process_set=process_set)  # fmt: skip
        sizes = [int(np.prod(tuple(v.shape), dtype=np.int64)) for v in vs]
        pieces = tf.split(flat, sizes) if len(vs) > 1 else [flat]
        for v, piece in zip(vs, pieces, strict=True):
            assigns.append(v.assign(tf.reshape(piece, v.shape)))
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None and hasattr(a, "op")])


def broadcast_global_variables(root_rank: int) -> tf.Operation | None:
    """TF1 only in horovod; raises in eager mode like horovod (use broadcast_variables)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: T,
    root_rank: int = 0,
    session: object = None,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
) -> T:
    """``root_rank``'s picklable ``obj`` on every rank (eager)."""
    return _core.broadcast_object(obj, root_rank, name, util.resolve_process_set(process_set))


def broadcast_object_fn(
    root_rank: int = 0,
    session: object = None,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
) -> Callable[[object], object]:
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (horovod's TF1 helper)."""

    def fn(obj: object) -> object:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(
    obj: T,
    session: object = None,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
) -> list[T]:
    """Every rank's picklable ``obj``, in rank order (eager)."""
    return _core.allgather_object(obj, name, util.resolve_process_set(process_set))


class _Reducer:
    """Reduces a list of gradients (``None`` entries kept) the way horovod's tape does."""

    def __init__(
        self,
        compression: type[Compressor],
        sparse_as_dense: bool,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: Groups,
        process_set: ProcessSetArg,
    ):
        self.compression, self.sparse_as_dense, self.op = compression, sparse_as_dense, op
        self.groups, self.process_set = groups, process_set
        if op is ReduceOp.AVERAGE and gradient_predivide_factor != 1.0:
            self.prescale = 1.0 / gradient_predivide_factor
            self.postscale = float(gradient_predivide_factor)
        else:
            self.prescale = self.postscale = 1.0

    def active(self) -> bool:
        ps = util.resolve_process_set(self.process_set)
        if ps is None:
            return _core.size() > 1
        return bool(ps.included()) and util.process_set_size(ps) > 1

    def __call__(self, grads: Sequence[Gradient], sources: Sequence[Variable]) -> list[Gradient]:
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        if not self.active():
            return grads
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        for group in self._split(present, sources):
            reduced = ops.grouped_allreduce(
                [grads[i] for i in group], compression=self.compression, op=self.op,
                prescale_factor=self.prescale, postscale_factor=self.postscale,
                process_set=self.process_set,
            )  # fmt: skip
            for i, r in zip(group, reduced, strict=True):
                out[i] = r
        return out

    def reduce_shared(
        self,
        grads: Sequence[Gradient],
        sources: Sequence[Variable],
        local: set[Hashable],
        scale_local: bool,
    ) -> list[Gradient]:
        """Reduce the gradients of ``sources`` except those whose ``_ref`` is in ``local``.

        The local ones stay on this rank, divided by the process set's size when
        ``scale_local`` (horovod's ``scale_local_gradients``). The tape's ``gradient()`` and
        the TF1 optimizer's ``compute_gradients`` both reduce this way.
        """
        shared = [i for i, s in enumerate(sources) if _ref(s) not in local]
        reduced = self([grads[i] for i in shared], [sources[i] for i in shared])
        out = list(grads)
        for i, g in zip(shared, reduced, strict=True):
            out[i] = g
        if scale_local and local:
            n = float(util.process_set_size(self.process_set))
            for i, s in enumerate(sources):
                g = out[i]
                if _ref(s) in local and g is not None:
                    if isinstance(g, tf.IndexedSlices):
                        out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                    else:
                        out[i] = g / n
        return out

    def _split(self, present: list[int], sources: Sequence[Variable]) -> list[list[int]]:
        groups = self.groups
        if not present:
            return []
        if groups is None or groups == 0:
            return [present]
        if isinstance(groups, int):
            n = min(groups, len(present))
            size, extra = divmod(len(present), n)
            out, start = [], 0
            for g in range(n):
                end = start + size + (1 if g < extra else 0)
                out.append(present[start:end])
                start = end
            return out
        where = {id(s): i for i, s in enumerate(sources)}
        listed, out = set(), []
        for group in groups:
            idx = [where[id(v)] for v in group if id(v) in where and where[id(v)] in present]
            listed.update(idx)
            if idx:
                out.append(sorted(idx))
        out.extend([i] for i in present if i not in listed)
        return out


class _DistributedGradientTape:
    """Mixin of the run-time tape class: ``gradient()`` reduces across ranks."""

    _se_reducer: _Reducer
    _se_local: set[Hashable]
    _se_scale_local: bool

    def register_local_source(self, source: Variable) -> None:
        """Keep the gradient of ``source`` local (no allreduce)."""
        self._se_local.add(_ref(source))

    def gradient(
        self,
        target: Nest,
        sources: Nest,
        output_gradients: Nest = None,
        use_generic_names: bool = False,
        unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    ) -> Nest:
        grads = super().gradient(  # type: ignore[misc]
            target, sources, output_gradients, unconnected_gradients=unconnected_gradients
        )
        out = self._se_reducer.reduce_shared(
            tf.nest.flatten(grads, expand_composites=False),
            tf.nest.flatten(sources),
            self._se_local,
            self._se_scale_local,
        )
        return tf.nest.pack_sequence_as(sources, out)

    def get_local_and_global_gradients(
        self,
        target: Nest,
        sources: Sequence[Variable],
        output_gradients: Nest = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Variable, Gradient]], list[tuple[Variable, Gradient]]]:
        """``([(local source, grad)], [(global source, grad)])`` of one ``gradient()`` call."""
        grads = cast(
            "Sequence[Gradient]",
            self.gradient(target, sources, output_gradients, use_generic_names),
        )
        local: list[tuple[Variable, Gradient]] = []
        shared: list[tuple[Variable, Gradient]] = []
        for s, g in zip(sources, grads, strict=True):
            (local if _ref(s) in self._se_local else shared).append((s, g))
        return local, shared


def DistributedGradientTape(  # noqa: N802 - horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp | int | None = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSetArg = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so ``gradient()`` averages the gradients across ranks.

    Parameters
    ----------
    gradtape
        The tape that recorded the forward pass (after its ``with`` block).
    device_dense, device_sparse
        Accepted for horovod compatibility (the device is the gradients' own).
    compression
        ``Compression.none`` or ``Compression.fp16``.
    sparse_as_dense
        Make ``IndexedSlices`` gradients dense before the allreduce (else allgathered).
    op
        ``Average`` (default), ``Sum`` or ``Adasum``.
    gradient_predivide_factor
        With ``Average``: scale by ``1/f`` before the sum and ``f/size`` after.
    num_groups, groups
        An int (split the gradients into that many fused groups) or a list of lists of
        variables (each list one fused group); default one fused group.
    process_set
        Average among this set's members; other ranks get their own gradients back.
    scale_local_gradients
        Divide the gradients of local sources by ``size()`` (horovod's default).

    Returns
    -------
    tf.GradientTape
        An instance of a run-time subclass of ``type(gradtape)`` sharing its recording.
    """
    resolved = resolve_op(op, None, adasum=True)
    if gradient_predivide_factor != 1.0 and resolved is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups and groups is None:
        groups = num_groups
    if groups is not None and not (
        isinstance(groups, list) or (isinstance(groups, int) and groups > 0)
    ):
        raise ValueError(
            "groups should be a non-negative integer or a list of list of tf.Variable."
        )
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigurationError(
            f"DistributedGradientTape takes a tf.GradientTape, got {type(gradtape).__name__}"
        )
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {})
    tape = cls(
        persistent=gradtape._persistent,
        watch_accessed_variables=gradtape._watch_accessed_variables,
    )
    tape._tape = gradtape._tape
    tape._se_reducer = _Reducer(
        compression, sparse_as_dense, resolved, gradient_predivide_factor, groups, process_set
    )
    tape._se_local = set()
    tape._se_scale_local = scale_local_gradients
    return tape


def PartialDistributedGradientTape(  # noqa: N802 - horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp | int | None = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSetArg = global_process_set,
    local_layers: keras.layers.Layer | Sequence[keras.layers.Layer] | None = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` whose ``local_layers``' gradients stay local."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
