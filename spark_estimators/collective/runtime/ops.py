"""Framework-free implementations of the collective ops, shared by every adapter.

Each function validates its arguments in the caller's thread, builds a
:class:`~spark_estimators.collective.runtime.engine.Request` whose ``execute`` runs on the
engine thread after negotiation, submits it and returns the future. What differs between numpy and
torch (packing a fusion buffer, scaling in place, cloning) is behind
:class:`~spark_estimators.collective.runtime.arrays.ArrayOps` (:mod:`.arrays`).

Fusion: a grouped allreduce packs its tensors into one flat buffer (grown once per dtype and
device, then reused) and reduces it with a single backend call. Allreduces submitted one by one
(``allreduce_async_`` per tensor) carry a
:class:`~spark_estimators.collective.runtime.engine.Fusion`: the engine fuses those queued
together the same way (:func:`_run_fused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_estimators.collective.backends.base import DTYPES, FLOATING_DTYPES, Buffer, ReduceOp
from spark_estimators.collective.runtime import adasum as _adasum
from spark_estimators.collective.runtime import engine as eng
from spark_estimators.collective.runtime.arrays import ArrayOps, scale_array, write_result
from spark_estimators.collective.runtime.engine import Agreement, Fusion, Kind, Request
from spark_estimators.collective.runtime.negotiation import itemsize
from spark_estimators.collective.runtime.process_sets import global_root
from spark_estimators.errors import ConfigurationError


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_scaling(op: ReduceOp, dtype: str, prescale: float, postscale: float, name: str) -> None:
    if dtype.startswith("complex") and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        # Gloo/MPI have no such reduction: refuse it here, before anything is sent.
        raise ConfigurationError(
            f"op={op.name.title()} on {name!r} is not defined for complex tensors ({dtype}); "
            "use op=Sum or op=Average"
        )
    if dtype != "bool":
        # Integers average and scale as in Horovod: in float64, truncated toward zero.
        return
    if op is ReduceOp.AVERAGE:
        raise ConfigurationError(
            f"op=Average on {name!r} needs a numeric dtype, got {dtype}; use op=Sum (logical "
            "or), op=Min (and) or op=Max (or)"
        )
    if prescale != 1.0 or postscale != 1.0:
        raise ConfigurationError(
            f"prescale_factor/postscale_factor on {name!r} need a numeric dtype, got {dtype}"
        )


def allreduce(
    ops: ArrayOps,
    inputs: Sequence[Buffer],
    outputs: Sequence[Buffer],
    op: ReduceOp,
    name: str | None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    blocking: bool = False,
    process_set: Any = None,
) -> Future[Any]:
    """Reduce ``inputs`` into ``outputs`` (the same objects for in-place) as one fused op.

    All inputs share one dtype and device; the result future resolves to ``outputs``.
    ``op=ADASUM`` reduces each tensor with Adasum (see
    :mod:`~spark_estimators.collective.runtime.adasum`).
    """
    engine = eng.require("allreduce", process_set)
    display = name or engine.auto_name("allreduce")
    dtype, device = ops.dtype(inputs[0]), ops.device(inputs[0])
    for x in inputs[1:]:
        if ops.dtype(x) != dtype or ops.device(x) != device:
            raise ConfigurationError(
                f"grouped allreduce {display!r} mixes dtypes/devices ({dtype} on {device} and "
                f"{ops.dtype(x)} on {ops.device(x)}); group tensors by dtype and device"
            )
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    _check_scaling(op, dtype, prescale, postscale, display)
    if len(inputs) == 1:
        shapes: tuple[tuple[int, ...], ...] = (ops.shape(inputs[0]),)
        numel = _numel(shapes[0])
    else:
        shapes = tuple(ops.shape(x) for x in inputs)
        numel = sum(_numel(s) for s in shapes)
    backend = engine.backend
    if op is ReduceOp.ADASUM:
        return _adasum.submit(engine, ops, inputs, outputs, display, name, shapes, prescale,
                              postscale, blocking)  # fmt: skip
    native = (
        op is ReduceOp.AVERAGE
        and backend.native_average
        and prescale == postscale == 1.0
        and dtype in FLOATING_DTYPES  # integers: sum, then scale and truncate as Horovod does
    )
    wire_op = ReduceOp.SUM if op is ReduceOp.AVERAGE and not native else op
    post = postscale / backend.size if op is ReduceOp.AVERAGE and not native else postscale
    op_name = op.name  # an enum's .name is a property: read it once (a hot path)
    signature = (_ALLREDUCE, name, dtype, device, shapes, op_name, prescale, postscale)
    described = shapes[0] if len(shapes) == 1 else f"{len(shapes)} tensors {list(shapes)}"
    description = f"{display!r} {dtype} on {device}, shape {described}, op={op_name}"

    def payload() -> np.ndarray:
        one = len(inputs) == 1 and ops.is_contiguous(inputs[0])
        data = np.array(
            np.asarray(ops.flat_view(inputs[0]) if one else ops.pack(inputs)), copy=True
        )
        if prescale != 1.0:
            scale_array(data, prescale)
        return data.view(np.uint8)

    # The engine sends it inline when it fits the negotiation's current room.
    inline = payload if dtype in _NUMPY_DTYPES and numel > 0 and device == "cpu" else None

    fusion = None
    if numel > 0:
        part = _FusedPart(ops, inputs, outputs, dtype, numel, wire_op, prescale, post, backend)
        key = (id(ops), dtype, device, int(wire_op), prescale, post)
        fusion = Fusion(key, numel * itemsize(dtype), _run_fused, part)

    def execute(agreement: Agreement) -> Sequence[Buffer]:
        if numel == 0:
            return outputs
        if agreement.payloads is not None:
            reduced = _reduce_rows(agreement.payloads, dtype, numel, wire_op, backend.size, post)
            return write_result(ops, reduced, inputs, outputs)
        single = len(inputs) == 1 and ops.is_contiguous(outputs[0])
        if single:
            if outputs[0] is not inputs[0]:
                ops.copy_(outputs[0], inputs[0])
            flat = ops.flat_view(outputs[0])
        else:
            flat = ops.pack(inputs)
        if prescale != 1.0:
            ops.scale_(flat, prescale)
        backend.allreduce(flat, wire_op)
        if post != 1.0:
            ops.scale_(flat, post)
        if not single:
            ops.unpack(flat, outputs)
        return outputs

    return engine.submit(
        Request(
            Kind.ALLREDUCE,
            display,
            signature,
            execute,
            description,
            numel=numel,
            dtype=dtype,
            device=device,
            wire_op=wire_op,
            inline=inline,
            fusion=fusion,
        ),
        blocking=blocking,
    )


@dataclass(slots=True)
class _FusedPart:
    """One allreduce request's share of a fused reduction (see :func:`_run_fused`)."""

    ops: ArrayOps
    inputs: Sequence[Buffer]
    outputs: Sequence[Buffer]
    dtype: str
    numel: int
    wire_op: ReduceOp
    prescale: float
    post: float
    backend: Any


def _run_fused(requests: Sequence[Request], agreement: Agreement) -> list[Any]:
    """Reduce several queued allreduces as one (they share dtype, device, op and scaling).

    Their inputs are packed in request order into one buffer, reduced with one backend call
    (or from the inline payloads), and unpacked into each request's outputs.
    """
    parts: list[_FusedPart] = [r.fusion.part for r in requests if r.fusion is not None]
    first = parts[0]
    ops, backend = first.ops, first.backend
    outputs = [out for p in parts for out in p.outputs]
    if agreement.payloads is not None:
        total = sum(p.numel for p in parts)
        reduced = _reduce_rows(
            agreement.payloads, first.dtype, total, first.wire_op, backend.size, first.post
        )
        ops.unpack(ops.adopt(reduced, first.inputs[0]), outputs)
    else:
        flat = ops.pack([x for p in parts for x in p.inputs])
        if first.prescale != 1.0:
            ops.scale_(flat, first.prescale)
        backend.allreduce(flat, first.wire_op)
        if first.post != 1.0:
            ops.scale_(flat, first.post)
        ops.unpack(flat, outputs)
    return [p.outputs for p in parts]


_ALLREDUCE = Kind.ALLREDUCE.name
_NUMPY_DTYPES = frozenset(d for d in DTYPES if d != "bfloat16")


def _reduce_rows(
    payloads: np.ndarray, dtype: str, numel: int, op: ReduceOp, size: int, post: float
) -> np.ndarray:
    """Reduce the inline payloads of every rank, in rank order (identical on every rank)."""
    nbytes = numel * itemsize(dtype)
    rows = np.ascontiguousarray(payloads[:, :nbytes]).view(np.dtype(dtype))
    if op is ReduceOp.MIN:
        out = rows.min(axis=0)
    elif op is ReduceOp.MAX:
        out = rows.max(axis=0)
    elif op is ReduceOp.PRODUCT:
        out = rows.prod(axis=0, dtype=rows.dtype)
    else:
        out = rows.sum(axis=0, dtype=rows.dtype)
        if op is ReduceOp.AVERAGE:
            out = (out / size).astype(rows.dtype)
    if post != 1.0:
        scale_array(out, post)
    return np.ascontiguousarray(out)


def allgather(
    ops: ArrayOps, x: Buffer, name: str | None, blocking: bool = False, process_set: Any = None
) -> Future[Any]:
    """Concatenate ``x`` from every rank on dim 0 (which may differ across ranks)."""
    engine = eng.require("allgather", process_set)
    display = name or engine.auto_name("allgather")
    dtype, device, shape = ops.dtype(x), ops.device(x), ops.shape(x)
    if not shape:
        raise ConfigurationError(
            f"allgather {display!r} needs at least one dimension; reshape the scalar to (1,)"
        )
    signature = (Kind.ALLGATHER.name, name, dtype, device, shape[1:])
    description = f"{display!r} {dtype} on {device}, shape {shape}"
    backend = engine.backend

    def execute(agreement: Agreement) -> Buffer:
        src = x if ops.is_contiguous(x) else ops.clone(x)
        return ops.adopt(backend.allgather(src, agreement.dim0s), x)

    return engine.submit(
        Request(
            Kind.ALLGATHER,
            display,
            signature,
            execute,
            description,
            dtype=dtype,
            device=device,
            dim0=shape[0],
        ),
        blocking=blocking,
    )


def broadcast(
    ops: ArrayOps,
    x: Buffer,
    output: Buffer,
    root_rank: int,
    name: str | None,
    blocking: bool = False,
    process_set: Any = None,
) -> Future[Any]:
    """Copy ``root_rank``'s ``x`` into ``output`` on every rank (``output is x``: in place)."""
    engine = eng.require("broadcast", process_set)
    display = name or engine.auto_name("broadcast")
    root = _check_root(root_rank, engine.backend.size, display, process_set)
    dtype, device, shape = ops.dtype(x), ops.device(x), ops.shape(x)
    signature = (Kind.BROADCAST.name, name, dtype, device, shape, root)
    description = f"{display!r} {dtype} on {device}, shape {shape}, root_rank={root}"
    backend = engine.backend

    def execute(agreement: Agreement) -> Buffer:
        if output is not x:
            ops.copy_(output, x)
        if _numel(shape) == 0:
            return output
        if ops.is_contiguous(output):
            backend.broadcast(ops.flat_view(output), root)
        else:
            work = ops.clone(output)
            backend.broadcast(ops.flat_view(work), root)
            ops.copy_(output, work)
        return output

    return engine.submit(
        Request(
            Kind.BROADCAST, display, signature, execute, description, dtype=dtype, device=device
        ),
        blocking=blocking,
    )


def grouped_broadcast(
    ops: ArrayOps,
    xs: Sequence[Buffer],
    root_rank: int,
    name: str | None,
    blocking: bool = False,
    process_set: Any = None,
) -> Future[Any]:
    """Broadcast several tensors of one dtype and device in place, as one fused buffer."""
    engine = eng.require("broadcast", process_set)
    display = name or engine.auto_name("grouped_broadcast")
    root = _check_root(root_rank, engine.backend.size, display, process_set)
    dtype, device = ops.dtype(xs[0]), ops.device(xs[0])
    shapes = tuple(ops.shape(x) for x in xs)
    signature = (Kind.BROADCAST.name, name, dtype, device, shapes, root)
    description = f"{display!r} {dtype} on {device}, {len(shapes)} tensors {list(shapes)}"
    backend = engine.backend

    def execute(agreement: Agreement) -> Sequence[Buffer]:
        if sum(_numel(s) for s in shapes) == 0:
            return xs
        flat = ops.pack(xs)
        backend.broadcast(flat, root)
        ops.unpack(flat, xs)
        return xs

    return engine.submit(
        Request(
            Kind.BROADCAST, display, signature, execute, description, dtype=dtype, device=device
        ),
        blocking=blocking,
    )


def alltoall(
    ops: ArrayOps,
    x: Buffer,
    splits: Sequence[int] | None,
    name: str | None,
    blocking: bool = False,
    process_set: Any = None,
) -> Future[Any]:
    """Scatter rows of ``x`` to the ranks (``splits[r]`` rows to rank r); gather theirs.

    The future resolves to ``(received, received_splits)``, ``received_splits`` a numpy array.
    With a process set, ``splits`` has one entry per member, in the set's rank order.
    """
    engine = eng.require("alltoall", process_set)
    display = name or engine.auto_name("alltoall")
    size = engine.backend.size
    dtype, device, shape = ops.dtype(x), ops.device(x), ops.shape(x)
    if not shape:
        raise ConfigurationError(f"alltoall {display!r} needs at least one dimension")
    if splits is None:
        if shape[0] % size:
            raise ConfigurationError(
                f"alltoall {display!r}: first dimension {shape[0]} is not divisible by "
                f"size()={size}; pass splits= with one row count per rank"
            )
        send = [shape[0] // size] * size
    else:
        send = [int(s) for s in np.asarray(splits).reshape(-1).tolist()]
        if len(send) != size or min(send) < 0 or sum(send) != shape[0]:
            raise ConfigurationError(
                f"alltoall {display!r}: splits={send} must have size()={size} non-negative "
                f"entries summing to the first dimension {shape[0]}"
            )
    signature = (Kind.ALLTOALL.name, name, dtype, device, shape[1:])
    description = f"{display!r} {dtype} on {device}, shape {shape}, splits {send}"
    backend = engine.backend

    def execute(agreement: Agreement) -> tuple[Buffer, np.ndarray]:
        matrix = backend.allgather(np.asarray([send], dtype=np.int64), [1] * size)
        recv = np.asarray(matrix, dtype=np.int64)[:, backend.rank].copy()
        src = x if ops.is_contiguous(x) else ops.clone(x)
        return ops.adopt(backend.alltoall(src, send, [int(n) for n in recv]), x), recv

    return engine.submit(
        Request(
            Kind.ALLTOALL,
            display,
            signature,
            execute,
            description,
            dtype=dtype,
            device=device,
            dim0=shape[0],
        ),
        blocking=blocking,
    )


def reducescatter_rows(dim0: int, size: int) -> list[int]:
    """Rows each rank receives: as even as possible, the first ranks take the remainder."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def reducescatter(
    ops: ArrayOps,
    x: Buffer,
    op: ReduceOp,
    name: str | None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    blocking: bool = False,
    process_set: Any = None,
) -> Future[Any]:
    """Reduce ``x`` across ranks and give each rank its block of rows."""
    engine = eng.require("reducescatter", process_set)
    display = name or engine.auto_name("reducescatter")
    backend = engine.backend
    dtype, device, shape = ops.dtype(x), ops.device(x), ops.shape(x)
    if not shape:
        raise ConfigurationError(f"reducescatter {display!r} needs at least one dimension")
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    _check_scaling(op, dtype, prescale, postscale, display)
    wire_op = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
    post = postscale / backend.size if op is ReduceOp.AVERAGE else postscale
    rows = reducescatter_rows(shape[0], backend.size)
    signature = (Kind.REDUCESCATTER.name, name, dtype, device, shape, op.name, prescale, postscale)
    description = f"{display!r} {dtype} on {device}, shape {shape}, op={op.name}"

    def execute(agreement: Agreement) -> Buffer:
        src = x
        if prescale != 1.0 or not ops.is_contiguous(x):
            src = ops.clone(x)
        if prescale != 1.0:
            ops.scale_(src, prescale)
        out = ops.adopt(backend.reducescatter(src, wire_op, rows), x)
        if post != 1.0:
            ops.scale_(out, post)
        return out

    return engine.submit(
        Request(
            Kind.REDUCESCATTER, display, signature, execute, description, dtype=dtype, device=device
        ),
        blocking=blocking,
    )


def barrier(blocking: bool = False, process_set: Any = None) -> Future[Any]:
    """Negotiation alone synchronises every rank, so a barrier is one negotiation round."""
    engine = eng.require("barrier", process_set)
    return engine.submit(
        Request(Kind.BARRIER, "barrier", (Kind.BARRIER.name,), lambda a: None, "barrier"),
        blocking=blocking,
    )


def join(blocking: bool = False) -> Future[Any]:
    """Resolve to the last rank to join once every rank has called ``join()``."""
    engine = eng.require("join")
    request = Request(Kind.JOIN, "join", (Kind.JOIN.name,), lambda a: None, "join")
    return engine.submit(request, blocking=blocking)


def allgather_object(
    obj: Any, name: str | None, blocking: bool = False, process_set: Any = None
) -> Future[Any]:
    """Resolve to the list of every rank's ``obj`` (picklable), in rank order."""
    engine = eng.require("allgather_object", process_set)
    display = name or engine.auto_name("allgather_object")
    backend = engine.backend
    signature = (Kind.ALLGATHER_OBJECT.name, name)
    return engine.submit(
        Request(
            Kind.ALLGATHER_OBJECT,
            display,
            signature,
            lambda a: backend.allgather_object(obj),
            f"{display!r}",
        ),
        blocking=blocking,
    )


def broadcast_object(
    obj: Any, root_rank: int, name: str | None, blocking: bool = False, process_set: Any = None
) -> Future[Any]:
    """Resolve to ``root_rank``'s ``obj`` on every rank."""
    engine = eng.require("broadcast_object", process_set)
    display = name or engine.auto_name("broadcast_object")
    backend = engine.backend
    root = _check_root(root_rank, backend.size, display, process_set)
    signature = (Kind.BROADCAST_OBJECT.name, name, root)
    return engine.submit(
        Request(
            Kind.BROADCAST_OBJECT,
            display,
            signature,
            lambda a: backend.broadcast_object(obj, root),
            f"{display!r} root_rank={root}",
        ),
        blocking=blocking,
    )


def _check_root(root_rank: int, size: int, name: str, process_set: Any = None) -> int:
    """``root_rank`` checked, as a rank of the engine's group (global ranks map into a set)."""
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name!r}: root_rank={root_rank!r} is not an int") from None
    if process_set is not None:
        return global_root(process_set, root, repr(name))
    if not 0 <= root < size:
        raise ConfigurationError(f"{name!r}: root_rank={root} is not in [0, size()={size})")
    return root
