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

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from spark_estimators.collective.backends.base import (
    DTYPES,
    FLOATING_DTYPES,
    Buffer,
    ReduceOp,
)
from spark_estimators.collective.runtime import adasum as _adasum
from spark_estimators.collective.runtime import engine as eng
from spark_estimators.collective.runtime.arrays import ArrayOps, numel_of, scale_array, write_result
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.futures import (
    _FINISHED,
    _PENDING,
    FuturesHandle,
    Handle,
    OpFuture,
    OpRunner,
)
from spark_estimators.collective.runtime.negotiation import itemsize
from spark_estimators.collective.runtime.requests import (
    Agreement,
    Fusion,
    Kind,
    Request,
    cached_signature_hash,
)
from spark_estimators.errors import ConfigurationError

_T = TypeVar("_T")


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
    if (
        len(inputs) == 1
        and outputs[0] is inputs[0]
        and reduction.op is not ReduceOp.ADASUM
        and ops.is_contiguous(inputs[0])
    ):
        return allreduce_one(engine, ops, inputs[0], reduction.op, reduction.prescale,
                             reduction.postscale, call.name, call.blocking)  # fmt: skip
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
    shapes = tuple(ops.shape(x) for x in inputs)
    if op is ReduceOp.ADASUM:
        return _adasum.submit(engine, ops, inputs, outputs, display, name, shapes, prescale,
                              postscale, call.blocking)  # fmt: skip
    static = _Static(engine, ops, dtype, device, shapes, op, prescale, postscale, name, display)
    part = _FusedPart(static, inputs, outputs)
    return engine.submit(static.request(display, part), blocking=call.blocking)


def allreduce_one(
    engine: eng.Engine,
    ops: ArrayOps,
    x: Buffer,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    name: str | None,
    blocking: bool,
    result: Buffer | None = None,
) -> AllreduceOp:
    """Reduce the contiguous buffer ``x`` in place: the per-tensor hot path of :func:`allreduce`.

    ``allreduce_async_`` per gradient submits the same ops step after step: what depends only
    on the op's dtype, device, shape, reduction and name (the signature and its hash, the
    description, the fusion key...) is computed once per engine (:class:`_Static`) and each
    call makes one object, the :class:`AllreduceOp` that is the request, its future and its
    handle (``wait()`` returns ``result``, default ``x``). ``op`` must not be Adasum.
    """
    key = (ops.static_key(x), op, prescale, postscale, name)
    display = name or engine.auto_name("allreduce")
    static = engine.statics.get(key)
    if not isinstance(static, _Static):
        static = _Static(engine, ops, ops.dtype(x), ops.device(x), (ops.shape(x),), op,
                         prescale, postscale, name, display)  # fmt: skip
        if len(engine.statics) < _STATICS_SIZE:
            engine.statics[key] = static
    request = AllreduceOp(static, display, x, x if result is None else result)
    engine.submit(request, blocking)
    return request


_STATICS_SIZE = 4096


class _Static:
    """What an allreduce's requests share when their dtype, device, shapes and reduction agree.

    Checks the reduction against the dtype (a clear error before anything is sent) and works out
    the signature the ranks agree on, its hash, the op on the wire, the fusion key (``display``:
    the op's name in errors).
    """

    __slots__ = ("engine", "ops", "backend", "dtype", "device", "numel", "wire_op", "prescale",
                 "post", "signature", "hash", "detail", "fusion", "inline")  # fmt: skip

    def __init__(
        self,
        engine: eng.Engine,
        ops: ArrayOps,
        dtype: str,
        device: str,
        shapes: tuple[tuple[int, ...], ...],
        op: ReduceOp,
        prescale: float,
        postscale: float,
        name: str | None,
        display: str,
    ) -> None:
        prescale, postscale = float(prescale), float(postscale)
        check_scaling(op, dtype, prescale, postscale, display)
        backend = engine.backend
        native = (
            op is ReduceOp.AVERAGE
            and backend.native_average
            and prescale == postscale == 1.0
            and dtype in FLOATING_DTYPES  # integers: sum, then scale and truncate as Horovod does
        )
        wire_op, post = Reduction(op, prescale, postscale).on_wire(backend.size, native)
        self.engine, self.ops, self.backend = engine, ops, backend
        self.dtype, self.device = dtype, device
        self.numel = sum(numel_of(s) for s in shapes)
        self.wire_op, self.prescale, self.post = wire_op, prescale, post
        op_name = op.name
        self.signature = (_ALLREDUCE, name, dtype, device, shapes, op_name, prescale, postscale)
        self.hash = cached_signature_hash(self.signature)
        described = shapes[0] if len(shapes) == 1 else f"{len(shapes)} tensors {list(shapes)}"
        self.detail = f"{dtype} on {device}, shape {described}, op={op_name}"
        self.fusion = None
        if self.numel > 0:
            key = (id(ops), dtype, device, int(wire_op), prescale, post)
            self.fusion = Fusion(key, self.numel * itemsize(dtype), _run_fused, _pack_fused)
        # The engine sends it inline when it fits the negotiation's current room.
        self.inline = dtype in _NUMPY_DTYPES and self.numel > 0 and device == "cpu"

    def request(self, display: str, part: _FusedPart) -> Request:
        """The request of one op of this kind on ``part``'s buffers."""
        return Request(Kind.ALLREDUCE, display, self.signature, part.execute, None, self.numel,
                       self.dtype, self.device, self.wire_op, 0,
                       part.payload if self.inline else None, self.fusion, part, self.detail,
                       self.hash)  # fmt: skip


class _FusedPart:
    """One allreduce request's buffers: what it reduces alone or in a fused batch."""

    __slots__ = ("static", "inputs", "outputs")

    def __init__(self, static: _Static, inputs: Sequence[Buffer], outputs: Sequence[Buffer]):
        self.static, self.inputs, self.outputs = static, inputs, outputs

    def payload(self) -> np.ndarray:
        """The (prescaled) data of this rank as bytes, to travel inside the negotiation."""
        return _payload(self)

    def execute(self, agreement: Agreement) -> Sequence[Buffer]:
        """Reduce this request alone (after negotiation, on the engine's thread)."""
        return _execute(self, agreement)


class AllreduceOp(Request, OpFuture, Handle):
    """One per-tensor in-place allreduce: its request, its part, its future and its handle.

    ``allreduce_async_`` per gradient makes one per tensor and step, so it is one object: what
    a request of its kind shares (signature, hash, fusion, description) is read from its
    :class:`_Static`, the engine settles it as its future (``future`` is itself) and the caller
    waits on it as its handle (``synchronize`` returns the caller's tensor).
    """

    __slots__ = ("static", "inputs", "outputs", "_tensor", "_state", "_result", "_exception",
                 "_callbacks")  # fmt: skip
    kind = Kind.ALLREDUCE
    dim0 = 0
    settles_itself = True

    def __init__(self, static: _Static, name: str, x: Buffer, tensor: Buffer) -> None:
        # No Request/OpFuture __init__: the shared fields come from ``static``.
        self.static, self.name, self._tensor = static, name, tensor
        self.inputs = self.outputs = [x]
        self.signature, self.numel, self.fusion = static.signature, static.numel, static.fusion
        self.dtype, self.device, self.wire_op = static.dtype, static.device, static.wire_op
        self._state, self._result, self._exception, self._callbacks = _PENDING, None, None, None
        self.queued_ns = 0

    @property
    def _engine(self) -> OpRunner:  # type: ignore[override]
        return self.static.engine

    @property
    def future(self) -> OpFuture:  # type: ignore[override]
        """The op itself (it is its own future)."""
        return self

    @property
    def part(self) -> AllreduceOp:  # type: ignore[override]
        """The op itself (its buffers are its own)."""
        return self

    @property
    def inline(self) -> Callable[[], np.ndarray] | None:  # type: ignore[override]
        """:meth:`payload` when the op may travel inside the negotiation."""
        return self.payload if self.static.inline else None

    @property
    def description(self) -> str:
        """The op as errors and the timeline show it (name, dtype, shape...)."""
        return f"{self.name!r} {self.static.detail}"

    @property
    def signature_hash(self) -> int:
        """The hash of the signature (the static's)."""
        return self.static.hash

    def payload(self) -> np.ndarray:
        """The (prescaled) data of this rank as bytes, to travel inside the negotiation."""
        return _payload(self)

    def execute(self, agreement: Agreement) -> Sequence[Buffer]:  # type: ignore[override]
        """Reduce this op alone (after negotiation, on the engine's thread)."""
        return _execute(self, agreement)

    def wait(self) -> Buffer:
        """Block until the op finished and return the caller's tensor (raises the op's error)."""
        if self._state != _FINISHED:
            self._wait(None)
        if self._exception is not None:
            raise self._exception
        return self._tensor

    def poll(self) -> bool:
        """True when the op has finished; else the engine is asked to run it soon."""
        if self._state == _FINISHED:
            return True
        self._engine.flush()
        return False

    def then(self, fn: Callable[[_T], object]) -> Handle:
        """A handle of this op whose :meth:`wait` returns ``fn`` of the caller's tensor."""
        return FuturesHandle([self], self.name, lambda results: self._tensor).then(fn)


def _payload(part: _FusedPart | AllreduceOp) -> np.ndarray:
    """``part``'s (prescaled) data as bytes, to travel inside the negotiation."""
    inputs, st = part.inputs, part.static
    ops = st.ops
    one = len(inputs) == 1 and ops.is_contiguous(inputs[0])
    data = np.array(np.asarray(ops.flat_view(inputs[0]) if one else ops.pack(inputs)), copy=True)
    if st.prescale != 1.0:
        scale_array(data, st.prescale)
    return data.view(np.uint8)


def _execute(part: _FusedPart | AllreduceOp, agreement: Agreement) -> Sequence[Buffer]:
    """Reduce ``part``'s buffers alone (after negotiation, on the engine's thread)."""
    inputs, outputs, st = part.inputs, part.outputs, part.static
    ops, backend = st.ops, st.backend
    if st.numel == 0:
        return outputs
    if agreement.payloads is not None:
        if len(outputs) > 1 and st.device == "cpu":
            _unpack_rows(agreement.payloads, st, st.numel, inputs[0], outputs)
            return outputs
        reduced = _reduce_rows(
            agreement.payloads, st.dtype, st.numel, st.wire_op, backend.size, st.post
        )
        return write_result(ops, reduced, inputs, outputs)
    single = len(inputs) == 1 and ops.is_contiguous(outputs[0])
    if single:
        if outputs[0] is not inputs[0]:
            ops.copy_(outputs[0], inputs[0])
        flat = ops.flat_view(outputs[0])
    else:
        flat = ops.pack(inputs)
    if st.prescale != 1.0:
        ops.scale_(flat, st.prescale)
    backend.allreduce(flat, st.wire_op)
    if st.post != 1.0:
        ops.scale_(flat, st.post)
    if not single:
        ops.unpack(flat, outputs)
    return outputs


def _run_fused(requests: Sequence[Request], agreement: Agreement) -> list[Sequence[Buffer]]:
    """Reduce several queued allreduces as one (they share dtype, device, op and scaling).

    Their inputs are packed in request order into one buffer, reduced with one backend call
    (or from the inline payloads), and unpacked into each request's outputs.
    """
    parts: list[_FusedPart | AllreduceOp] = [r.part for r in requests]
    first = parts[0].static
    ops, backend = first.ops, first.backend
    outputs = [out for p in parts for out in p.outputs]
    if agreement.payloads is not None:
        total = sum([p.static.numel for p in parts])
        _unpack_rows(agreement.payloads, first, total, parts[0].inputs[0], outputs)
    else:
        flat = ops.pack([x for p in parts for x in p.inputs])
        if first.prescale != 1.0:
            ops.scale_(flat, first.prescale)
        backend.allreduce(flat, first.wire_op)
        if first.post != 1.0:
            ops.scale_(flat, first.post)
        ops.unpack(flat, outputs)
    return [p.outputs for p in parts]


def _unpack_rows(
    payloads: np.ndarray, st: _Static, numel: int, like: Buffer, outputs: Sequence[Buffer]
) -> None:
    """Reduce the inline ``payloads`` into a reused buffer, then copy it into ``outputs``.

    The thread's reused buffer (:meth:`ArrayOps.scratch`, rather than a new array per round)
    lets the ops keep its views in the outputs' shapes: the unpack of a repeated batch is one
    bulk copy. CPU only.
    """
    ops = st.ops
    flat = ops.scratch(like, numel)
    _reduce_rows(payloads, st.dtype, numel, st.wire_op, st.backend.size, st.post,
                 out=np.asarray(flat))  # fmt: skip
    ops.unpack(flat, outputs)


def _pack_fused(requests: Sequence[Request], out: np.ndarray) -> None:
    """Write the (prescaled) data of ``requests`` into ``out`` (bytes), as inline payloads."""
    parts: list[_FusedPart | AllreduceOp] = [r.part for r in requests]
    first = parts[0].static
    typed = out.view(np.dtype(first.dtype))
    flat = first.ops.adopt(typed, parts[0].inputs[0])  # the same memory
    first.ops.pack_into([x for p in parts for x in p.inputs], flat)
    if first.prescale != 1.0:
        scale_array(typed, first.prescale)


_ALLREDUCE = Kind.ALLREDUCE.name
_NUMPY_DTYPES = frozenset(d for d in DTYPES if d != "bfloat16")


def _reduce_rows(
    payloads: np.ndarray,
    dtype: str,
    numel: int,
    op: ReduceOp,
    size: int,
    post: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Reduce the inline payloads of every rank, in rank order (identical on every rank).

    Into ``out`` (``numel`` elements of ``dtype``, contiguous) when given, else a new array.
    """
    nbytes = numel * itemsize(dtype)
    rows = np.ascontiguousarray(payloads[:, :nbytes]).view(np.dtype(dtype))
    if op is ReduceOp.MIN:
        out = rows.min(axis=0, out=out)
    elif op is ReduceOp.MAX:
        out = rows.max(axis=0, out=out)
    elif op is ReduceOp.PRODUCT:
        out = rows.prod(axis=0, dtype=rows.dtype, out=out)
    else:
        if len(rows) == 2:  # the same bits as the sum along axis 0, without its reduce set-up
            out = np.add(rows[0], rows[1], out=out)
        else:
            out = rows.sum(axis=0, dtype=rows.dtype, out=out)
    finish_rows(out, op, size, post)
    return np.ascontiguousarray(out)


def finish_rows(out: np.ndarray, op: ReduceOp, size: int, post: float) -> None:
    """The end of an inline reduction of ``size`` rows summed into ``out``, in place.

    ``Average`` (the backend's native average) divides by ``size`` (a float array in its own
    dtype, the bits of ``out / size``; other dtypes through ``out / size`` and a cast back), then
    ``post`` scales (:func:`scale_array`). Shared by :func:`_reduce_rows` and the optimizer's
    steady state, so both give the same bits.
    """
    if op is ReduceOp.AVERAGE:
        if out.dtype.kind == "f":
            np.divide(out, out.dtype.type(size), out=out)
        else:
            out[...] = (out / size).astype(out.dtype)
    if post != 1.0:
        scale_array(out, post)
