"""TensorFlow collective ops with Horovod's names, arguments and gradients.

Each op runs through :func:`spark_estimators.collective.tensorflow.util.run` (eagerly, or in one
``tf.py_function`` inside ``tf.function``) over the core ops of
:mod:`spark_estimators.collective`, so fusion, process sets, Adasum and the backends (Gloo, MPI,
NCCL) are the ones every adapter shares. ``allreduce``, ``grouped_allreduce``, ``allgather``,
``grouped_allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` and
``grouped_reducescatter`` are differentiable with horovod's gradients (``tf.custom_gradient``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from spark_estimators import collective as _core
from spark_estimators.collective.backends.base import ReduceOp, resolve_op
from spark_estimators.collective.runtime import process_sets
from spark_estimators.collective.runtime.process_sets import global_process_set
from spark_estimators.collective.tensorflow import util
from spark_estimators.collective.tensorflow._types import (
    Array,
    Body,
    Grad,
    ProcessSetArg,
    TensorLike,
    Variable,
)
from spark_estimators.collective.tensorflow.compression import Compression, Compressor
from spark_estimators.collective.tensorflow.util import InvalidCollectiveArgument, run

Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM


def _tensor(x: TensorLike) -> tf.Tensor:
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


def _ps(process_set: ProcessSetArg) -> ProcessSetArg:
    ps = util.resolve_process_set(process_set)
    if ps is not None and ps not in process_sets.registered():
        raise InvalidCollectiveArgument(
            f"{ps!r} is not a registered process set: register it on every rank with "
            "hvd.add_process_set(...) or hvd.init(process_sets=[...])"
        )
    if ps is not None and ps.included() is False:
        # horovod raises InvalidArgumentError here (a local error, nothing was sent)
        raise InvalidCollectiveArgument(
            f"rank {_core.rank()} is not a member of {ps!r}; only ranks {ps.ranks} may run ops "
            "on it"
        )
    return ps


def _label(name: str | None, i: int, n: int) -> str | None:
    return name if name is None or n == 1 else f"{name}.{i}"


#: dtypes Gloo moves as byte views; empty ones fail there, so they travel as uint8 rows here.
_BYTE_VIEWED = frozenset({"int16", "uint16", "uint32", "uint64"})


def _wire(array: Array) -> tuple[Array, Callable[[Array], Array]]:
    """The array to move (allgather/alltoall) and a function restoring a received array.

    Rows of no elements (shape ``(n, 0, ...)``) travel as ``(n, 1)`` uint8 rows, and the dtypes
    Gloo moves as bytes travel as uint8 rows of their bytes (the backend cannot view empty ones
    as bytes). Every rank has the same row shape and dtype (else the op is a mismatch), so every
    rank converts alike.
    """
    if not isinstance(array, np.ndarray) or array.ndim == 0:
        return array, lambda out: out
    rows, dtype, tail = array.shape[0], array.dtype, array.shape[1:]
    per_row = int(np.prod(tail, dtype=np.int64))
    if per_row == 0:
        return np.zeros((rows, 1), np.uint8), lambda out: np.zeros((out.shape[0], *tail), dtype)
    if dtype.name not in _BYTE_VIEWED:
        return array, lambda out: out
    sent = np.ascontiguousarray(array).reshape(rows, per_row).view(np.uint8)
    return sent, lambda out: np.ascontiguousarray(out).view(dtype).reshape(out.shape[0], *tail)


# -- allreduce ----------------------------------------------------------------------------------
def _reduce_body(
    op: ReduceOp, pre: float, post: float, name: str | None, ps: ProcessSetArg
) -> Body:
    def body(*arrays: Array) -> list[Array]:
        core = util.core_for(arrays)
        if core is not _core:  # pragma: no cover - torch CUDA tensors (nccl)
            return list(core.grouped_allreduce(list(arrays), op=op, name=name,
                        prescale_factor=pre, postscale_factor=post, process_set=ps))  # fmt: skip
        bufs = [util.aligned_copy(np.asarray(a)) for a in arrays]
        if len(bufs) == 1:
            _core.allreduce_(bufs[0], op, name, pre, post, process_set=ps)
        else:
            _core.grouped_allreduce_(bufs, op, name, pre, post, ps)
        return list(bufs)

    return body


def _grouped_allreduce_raw(
    tensors: Sequence[tf.Tensor],
    op: ReduceOp,
    pre: float,
    post: float,
    name: str | None,
    ps: ProcessSetArg,
) -> list[tf.Tensor]:
    """Differentiable fused allreduce of dense tensors (gradient: the same reduction)."""

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], Grad]:
        outs = run(
            _reduce_body(op, pre, post, name, ps),
            xs,
            [x.dtype for x in xs],
            [x.shape for x in xs],
        )

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _grouped_allreduce_raw([_tensor(d) for d in dys], op, pre, post, None, ps)

        return outs, grad

    return list(forward(*[_tensor(t) for t in tensors]))


def _check_adasum(op: ReduceOp, process_set: ProcessSetArg) -> None:
    if op is Adasum and _ps(process_set) is not None:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")


def _sparse_allreduce(
    tensor: tf.IndexedSlices, op: ReduceOp, pre: float, post: float, process_set: ProcessSetArg
) -> tf.IndexedSlices:
    if op is Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a workaround "
            "please pass sparse_as_dense=True to DistributedOptimizer"
        )
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values, indices = grouped_allgather([tensor.values, tensor.indices], process_set=process_set)
    if op is Average:
        values = values / tf.cast(util.process_set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


def allreduce(
    tensor: TensorLike | tf.IndexedSlices,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
    ignore_name_scope: bool = False,
) -> tf.Tensor | tf.IndexedSlices:
    """Reduce a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` across ranks.

    Parameters
    ----------
    tensor
        Same shape and dtype on every rank. An ``IndexedSlices`` is allgathered (values and
        indices), as in horovod.
    average
        Deprecated: ``False`` means ``op=Sum``.
    device_dense, device_sparse, ignore_name_scope
        Accepted for horovod compatibility (the device is the tensor's own).
    compression
        ``Compression.none`` or ``Compression.fp16``.
    op
        ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
    prescale_factor, postscale_factor
        Multiply before / after the reduction.
    name
        Op name (the same on every rank when given).
    process_set
        Reduce among this process set's members only.

    Returns
    -------
    tf.Tensor or tf.IndexedSlices
        The reduction, same shape and dtype; differentiable (its gradient is the same
        reduction of the incoming gradient).
    """
    resolved = resolve_op(op, average, adasum=True)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, resolved, prescale_factor, postscale_factor, process_set)
    _check_adasum(resolved, process_set)
    compressed, ctx = compression.compress(_tensor(tensor))
    (reduced,) = _grouped_allreduce_raw(
        [compressed], resolved, float(prescale_factor), float(postscale_factor), name,
        _ps(process_set),
    )  # fmt: skip
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[TensorLike | tf.IndexedSlices],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSetArg = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[tf.Tensor | tf.IndexedSlices]:
    """Reduce several tensors in one fused operation per dtype (see :func:`allreduce`).

    ``IndexedSlices`` among them are allgathered (values and indices), the dense ones go
    through one fusion buffer per dtype - the same fused path as the torch adapter.
    """
    if not tensors:
        return list(tensors)
    resolved = resolve_op(op, average, adasum=True)
    out: list[tf.Tensor | tf.IndexedSlices] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i in sparse:
        out[i] = _sparse_allreduce(
            tensors[i], resolved, prescale_factor, postscale_factor, process_set
        )
    if dense:
        _check_adasum(resolved, process_set)
        pairs = [compression.compress(_tensor(tensors[i])) for i in dense]
        reduced = _grouped_allreduce_raw(
            [p[0] for p in pairs], resolved, float(prescale_factor), float(postscale_factor),
            name, _ps(process_set),
        )  # fmt: skip
        for i, r, (_, ctx) in zip(dense, reduced, pairs, strict=True):
            out[i] = compression.decompress(r, ctx)
    return out


# -- allgather ----------------------------------------------------------------------------------
def _gather_body(name: str | None, ps: ProcessSetArg) -> Body:
    def body(*arrays: Array) -> list[Array]:
        core = util.core_for(arrays)
        out = []
        for i, a in enumerate(arrays):
            sent, back = _wire(a)
            out.append(
                back(core.allgather(sent, name=_label(name, i, len(arrays)), process_set=ps))
            )
        return out

    return body


def _gathered_sizes(x: tf.Tensor, ps: ProcessSetArg) -> tf.Tensor:
    with tf.device("/cpu:0"):
        d0 = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
        (sizes,) = run(_gather_body(None, ps), [d0], [tf.int64], [tf.TensorShape([None])])
    return sizes


def grouped_allgather(
    tensors: Sequence[TensorLike],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSetArg = global_process_set,
) -> list[tf.Tensor]:
    """Concatenate every rank's tensors on the first dimension (which may differ by rank).

    Differentiable as in horovod: the gradient is the averaged gradient's block of this rank.
    """
    if not tensors:
        return []
    ps = _ps(process_set)

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], Grad]:
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        outs = run(_gather_body(name, ps), xs, [x.dtype for x in xs], shapes)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            me = _core.rank() if ps is None else ps.rank()
            assert me is not None  # _ps refused a rank outside the set
            results = []
            for x, dy in zip(xs, dys, strict=True):
                (avg,) = _grouped_allreduce_raw([_tensor(dy)], Average, 1.0, 1.0, None, ps)
                sizes = _gathered_sizes(x, ps)
                start = tf.reduce_sum(sizes[:me])
                results.append(avg[start : start + sizes[me]])
            return results

        return outs, grad

    return list(forward(*[_tensor(t) for t in tensors]))


def allgather(
    tensor: TensorLike,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSetArg = global_process_set,
) -> tf.Tensor:
    """Concatenate every rank's tensor on the first dimension (which may differ by rank)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


# -- broadcast ----------------------------------------------------------------------------------
def _broadcast_body(root_rank: int, name: str | None, ps: ProcessSetArg) -> Body:
    def body(*arrays: Array) -> list[Array]:
        core = util.core_for(arrays)
        return [
            core.broadcast(a, root_rank, name=_label(name, i, len(arrays)), process_set=ps)
            for i, a in enumerate(arrays)
        ]

    return body


def broadcast(
    tensor: TensorLike,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSetArg = global_process_set,
) -> tf.Tensor:
    """``root_rank``'s tensor on every rank (``root_rank`` is a global rank).

    Differentiable as in horovod: the averaged gradient on the root, zeros elsewhere.
    """
    ps = _ps(process_set)

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> tuple[tf.Tensor, Grad]:
        (out,) = run(_broadcast_body(root_rank, name, ps), [x], [x.dtype], [x.shape])

        def grad(dy: tf.Tensor) -> tf.Tensor:
            (avg,) = _grouped_allreduce_raw([_tensor(dy)], Average, 1.0, 1.0, None, ps)
            return avg if _core.rank() == root_rank else avg * 0

        return out, grad

    return forward(_tensor(tensor))


def broadcast_(
    variables: Sequence[Variable],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
) -> list[tf.Tensor]:
    """Overwrite ``variables`` with ``root_rank``'s values, in place; returns their values."""
    variables = list(variables)
    if not variables:
        return []
    ps = _ps(process_set)
    values = run(
        _broadcast_body(root_rank, name, ps),
        [v.read_value() if hasattr(v, "read_value") else v for v in variables],
        [v.dtype.base_dtype for v in variables],
        [v.shape for v in variables],
    )
    assigns = [v.assign(x) for v, x in zip(variables, values, strict=True)]
    if tf.executing_eagerly():
        return [v.read_value() for v in variables]
    with tf.control_dependencies(assigns):
        return [tf.identity(v.read_value()) for v in variables]


# -- alltoall -----------------------------------------------------------------------------------
def _alltoall_body(name: str | None, ps: ProcessSetArg, equal: bool) -> Body:
    def body(array: Array, splits: Array) -> list[Array]:
        core = util.core_for([array])
        size = util.process_set_size(ps)
        if equal:
            if array.ndim == 0 or array.shape[0] % size:
                raise InvalidCollectiveArgument(
                    f"alltoall: the first dimension of a tensor of shape {tuple(array.shape)} "
                    f"must be divisible by the number of ranks ({size}) when splits is not given"
                )
            split_list = [array.shape[0] // size] * size
        else:
            split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
        sent, back = _wire(array)
        out, received = core.alltoall(sent, splits=split_list, name=name, process_set=ps)
        return [back(out), np.asarray(received, dtype=np.int32)]

    return body


def alltoall(
    tensor: TensorLike,
    splits: TensorLike | Sequence[int] | None = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSetArg = global_process_set,
) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; receive and concatenate theirs.

    Returns the received tensor, and with ``splits`` given also the received row counts
    (int32), as horovod. Differentiable (the gradient goes back with the received counts).
    """
    ps = _ps(process_set)
    given = splits is not None
    splits_t = tf.convert_to_tensor(splits) if given else tf.constant([], dtype=tf.int32)

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> tuple[tf.Tensor, Grad]:
        shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else None
        out, received = run(
            _alltoall_body(name, ps, not given), [x, splits_t], [x.dtype, tf.int32],
            [shape, tf.TensorShape([None])],
        )  # fmt: skip

        def grad(dy: tf.Tensor, *unused: tf.Tensor) -> tf.Tensor:
            back, _ = alltoall(_tensor(dy), splits=received, process_set=process_set)
            return back

        return (out, received), grad

    out, received = forward(_tensor(tensor))
    return (out, received) if given else out


# -- reducescatter ------------------------------------------------------------------------------
def _scatter_body(
    op: ReduceOp, pre: float, post: float, name: str | None, ps: ProcessSetArg
) -> Body:
    def body(*arrays: Array) -> list[Array]:
        core = util.core_for(arrays)
        return [
            core.reducescatter(
                a, op=op, name=_label(name, i, len(arrays)), prescale_factor=pre,
                postscale_factor=post, process_set=ps,
            )
            for i, a in enumerate(arrays)
        ]  # fmt: skip

    return body


def grouped_reducescatter(
    tensors: Sequence[TensorLike],
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = Average,
    process_set: ProcessSetArg = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[tf.Tensor]:
    """Reduce each tensor across ranks; rank r gets block r of each first dimension."""
    if not tensors:
        return []
    resolved = resolve_op(op, None)
    ps = _ps(process_set)
    pre, post = float(prescale_factor), float(postscale_factor)
    pairs = [compression.compress(_tensor(t)) for t in tensors]
    for t, _ in pairs:
        if t.shape.rank == 0:
            raise InvalidCollectiveArgument("reducescatter needs tensors of at least one dimension")

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], Grad]:
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        outs = run(_scatter_body(resolved, pre, post, name, ps), xs, [x.dtype for x in xs], shapes)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            scale = pre * post * (util.process_set_size(ps) if resolved is Sum else 1)
            scaled = [_tensor(d) * tf.cast(scale, d.dtype) if scale != 1 else d for d in dys]
            return grouped_allgather(scaled, process_set=process_set)

        return outs, grad

    reduced = forward(*[p[0] for p in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs, strict=True)]


def reducescatter(
    tensor: TensorLike,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = Average,
    name: str | None = None,
    process_set: ProcessSetArg = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce across ranks; rank r gets block r of the first dimension (first ranks get more)."""
    return grouped_reducescatter(
        [tensor], device_dense, compression, op, process_set, prescale_factor, postscale_factor,
        name,
    )[0]  # fmt: skip
