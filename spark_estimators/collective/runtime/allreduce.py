"""The allreduce op, framework-free: one tensor or a group, fused with its queued neighbours.

:func:`allreduce` validates its arguments in the caller's thread and submits a
:class:`~spark_estimators.collective.runtime.requests.Request` to the engine. A group is packed
into one flat buffer (grown once per dtype and device, then reused) and reduced with a single
backend call. Allreduces submitted one by one (``allreduce_async_`` per tensor) carry a
:class:`~spark_estimators.collective.runtime.requests.Fusion`: the engine fuses those queued
together the same way (:func:`_run_fused`). A small CPU allreduce also offers its data inline
(it travels inside the negotiation round, see :mod:`.engine`), reduced by :func:`_reduce_rows`.
The other ops are in :mod:`.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from spark_estimators.collective.backends.base import (
    DTYPES,
    FLOATING_DTYPES,
    Backend,
    Buffer,
    ReduceOp,
)
from spark_estimators.collective.runtime import adasum as _adasum
from spark_estimators.collective.runtime import engine as eng
from spark_estimators.collective.runtime.arrays import ArrayOps, numel_of, scale_array, write_result
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.negotiation import itemsize
from spark_estimators.collective.runtime.requests import Agreement, Fusion, Kind, Request
from spark_estimators.errors import ConfigurationError


@dataclass(slots=True)
class Reduction:
    """A reduce op with Horovod's scale factors: ``postscale * op(prescale * x)`` across ranks.

    What allreduce and reducescatter share: the ranks must agree on all three, and both refuse a
    dtype that cannot take them (:meth:`check`) and run ``Average`` as a sum (:meth:`on_wire`).
    """

    op: ReduceOp
    prescale: float = 1.0
    postscale: float = 1.0

    def __post_init__(self) -> None:
        self.prescale, self.postscale = float(self.prescale), float(self.postscale)

    def check(self, dtype: str, name: str) -> None:
        """Refuse, before anything is sent, a reduction or scaling that ``dtype`` cannot take."""
        check_scaling(self.op, dtype, self.prescale, self.postscale, name)

    def on_wire(self, size: int, native_average: bool = False) -> tuple[ReduceOp, float]:
        """The op the backend runs and the factor applied after it, among ``size`` ranks.

        ``Average`` is a sum scaled by ``1 / size`` unless the backend averages natively.
        """
        if self.op is ReduceOp.AVERAGE and not native_average:
            return ReduceOp.SUM, self.postscale / size
        return self.op, self.postscale


def check_scaling(op: ReduceOp, dtype: str, prescale: float, postscale: float, name: str) -> None:
    """Refuse, before anything is sent, a reduction or scaling that ``dtype`` cannot take."""
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
    reduction: Reduction,
    call: Call,
) -> Future[Sequence[Buffer]]:
    """Reduce ``inputs`` into ``outputs`` (the same objects for in-place) as one fused op.

    All inputs share one dtype and device; the result future resolves to ``outputs``.
    ``op=ADASUM`` reduces each tensor with Adasum (see
    :mod:`~spark_estimators.collective.runtime.adasum`).
    """
    engine = eng.require("allreduce", call.process_set)
    name, display = call.name, call.name or engine.auto_name("allreduce")
    dtype, device = ops.dtype(inputs[0]), ops.device(inputs[0])
    for x in inputs[1:]:
        if ops.dtype(x) != dtype or ops.device(x) != device:
            raise ConfigurationError(
                f"grouped allreduce {display!r} mixes dtypes/devices ({dtype} on {device} and "
                f"{ops.dtype(x)} on {ops.device(x)}); group tensors by dtype and device"
            )
    reduction.check(dtype, display)
    op, prescale, postscale = reduction.op, reduction.prescale, reduction.postscale
    if len(inputs) == 1:
        shapes: tuple[tuple[int, ...], ...] = (ops.shape(inputs[0]),)
        numel = numel_of(shapes[0])
    else:
        shapes = tuple(ops.shape(x) for x in inputs)
        numel = sum(numel_of(s) for s in shapes)
    backend = engine.backend
    if op is ReduceOp.ADASUM:
        return _adasum.submit(engine, ops, inputs, outputs, display, name, shapes, prescale,
                              postscale, call.blocking)  # fmt: skip
    native = (
        op is ReduceOp.AVERAGE
        and backend.native_average
        and prescale == postscale == 1.0
        and dtype in FLOATING_DTYPES  # integers: sum, then scale and truncate as Horovod does
    )
    wire_op, post = reduction.on_wire(backend.size, native)
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
        blocking=call.blocking,
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
    backend: Backend


def _run_fused(requests: Sequence[Request], agreement: Agreement) -> list[Sequence[Buffer]]:
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
