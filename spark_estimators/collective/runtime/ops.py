"""Framework-free implementations of the collective ops but allreduce, shared by every adapter.

Each function validates its arguments in the caller's thread, builds a
:class:`~spark_estimators.collective.runtime.requests.Request` whose ``execute`` runs on the
engine thread after negotiation, submits it and returns the future. The caller's name, blocking
flag and process set come as one :class:`~spark_estimators.collective.runtime.call.Call`. What
differs between numpy and torch (packing a fusion buffer, scaling in place, cloning) is behind
:class:`~spark_estimators.collective.runtime.arrays.ArrayOps` (:mod:`.arrays`).

The allreduce and its fusion are in :mod:`.allreduce`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from spark_estimators.collective.backends.base import Backend, Buffer
from spark_estimators.collective.runtime import engine as eng
from spark_estimators.collective.runtime.allreduce import Reduction
from spark_estimators.collective.runtime.arrays import ArrayOps, numel_of
from spark_estimators.collective.runtime.call import Call
from spark_estimators.collective.runtime.engine import Engine
from spark_estimators.collective.runtime.process_sets import ProcessSet, global_root
from spark_estimators.collective.runtime.requests import Agreement, Kind, Request
from spark_estimators.errors import ConfigurationError

#: An object sent to every rank and received as the same kind of object.
T = TypeVar("T")
#: What an op's future resolves to.
R = TypeVar("R")


@dataclass(slots=True)
class _Op:
    """What every array op starts from: its engine, its names, the input's dtype and device.

    ``name`` is the caller's (``None`` when not given: it is then left out of the signature the
    ranks agree on), ``display`` the one errors and the timeline show; ``blocking``: run the op
    in the caller's thread.
    """

    engine: Engine
    name: str | None
    display: str
    dtype: str
    device: str
    blocking: bool

    @property
    def backend(self) -> Backend:
        """The engine's backend."""
        return self.engine.backend

    def submit(
        self,
        kind: Kind,
        key: tuple[object, ...],
        execute: Callable[[Agreement], R],
        detail: str,
        dim0: int = 0,
    ) -> Future[R]:
        """Queue the op on the engine (or run it now when ``blocking``).

        ``key`` is what else the ranks must agree on besides the kind, name, dtype and device;
        ``detail`` what the description adds to the name, dtype and device.
        """
        signature = (kind.name, self.name, self.dtype, self.device, *key)
        description = f"{self.display!r} {self.dtype} on {self.device}, {detail}"
        request = Request(kind, self.display, signature, execute, description,
                          dtype=self.dtype, device=self.device, dim0=dim0)  # fmt: skip
        return self.engine.submit(request, blocking=self.blocking)


def _start(
    ops: ArrayOps, x: Buffer, what: str, call: Call, auto: str | None = None
) -> tuple[_Op, tuple[int, ...]]:
    """The op ``what`` on ``x``, and ``x``'s shape (``auto``: prefix of a generated name)."""
    engine = eng.require(what, call.process_set)
    display = call.name or engine.auto_name(auto or what)
    op = _Op(engine, call.name, display, ops.dtype(x), ops.device(x), call.blocking)
    return op, ops.shape(x)


def allgather(ops: ArrayOps, x: Buffer, call: Call) -> Future[Buffer]:
    """Concatenate ``x`` from every rank on dim 0 (which may differ across ranks)."""
    op, shape = _start(ops, x, "allgather", call)
    if not shape:
        raise ConfigurationError(
            f"allgather {op.display!r} needs at least one dimension; reshape the scalar to (1,)"
        )
    backend = op.backend

    def execute(agreement: Agreement) -> Buffer:
        src = x if ops.is_contiguous(x) else ops.clone(x)
        return ops.adopt(backend.allgather(src, agreement.dim0s), x)

    return op.submit(Kind.ALLGATHER, (shape[1:],), execute, f"shape {shape}", dim0=shape[0])


def broadcast(
    ops: ArrayOps, x: Buffer, output: Buffer, root_rank: int, call: Call
) -> Future[Buffer]:
    """Copy ``root_rank``'s ``x`` into ``output`` on every rank (``output is x``: in place)."""
    op, shape = _start(ops, x, "broadcast", call)
    backend = op.backend
    root = _check_root(root_rank, backend.size, op.display, call.process_set)

    def execute(agreement: Agreement) -> Buffer:
        if output is not x:
            ops.copy_(output, x)
        if numel_of(shape) == 0:
            return output
        if ops.is_contiguous(output):
            backend.broadcast(ops.flat_view(output), root)
        else:
            work = ops.clone(output)
            backend.broadcast(ops.flat_view(work), root)
            ops.copy_(output, work)
        return output

    return op.submit(Kind.BROADCAST, (shape, root), execute, f"shape {shape}, root_rank={root}")


def grouped_broadcast(
    ops: ArrayOps, xs: Sequence[Buffer], root_rank: int, call: Call
) -> Future[Sequence[Buffer]]:
    """Broadcast several tensors of one dtype and device in place, as one fused buffer."""
    op, _ = _start(ops, xs[0], "broadcast", call, "grouped_broadcast")
    backend = op.backend
    root = _check_root(root_rank, backend.size, op.display, call.process_set)
    shapes = tuple(ops.shape(x) for x in xs)

    def execute(agreement: Agreement) -> Sequence[Buffer]:
        if sum(numel_of(s) for s in shapes) == 0:
            return xs
        flat = ops.pack(xs)
        backend.broadcast(flat, root)
        ops.unpack(flat, xs)
        return xs

    detail = f"{len(shapes)} tensors {list(shapes)}"
    return op.submit(Kind.BROADCAST, (shapes, root), execute, detail)


def alltoall(
    ops: ArrayOps, x: Buffer, splits: Sequence[int] | None, call: Call
) -> Future[tuple[Buffer, np.ndarray]]:
    """Scatter rows of ``x`` to the ranks (``splits[r]`` rows to rank r); gather theirs.

    The future resolves to ``(received, received_splits)``, ``received_splits`` a numpy array.
    With a process set, ``splits`` has one entry per member, in the set's rank order.
    """
    op, shape = _start(ops, x, "alltoall", call)
    display, backend = op.display, op.backend
    size = backend.size
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

    def execute(agreement: Agreement) -> tuple[Buffer, np.ndarray]:
        matrix = backend.allgather(np.asarray([send], dtype=np.int64), [1] * size)
        recv = np.asarray(matrix, dtype=np.int64)[:, backend.rank].copy()
        src = x if ops.is_contiguous(x) else ops.clone(x)
        return ops.adopt(backend.alltoall(src, send, [int(n) for n in recv]), x), recv

    detail = f"shape {shape}, splits {send}"
    return op.submit(Kind.ALLTOALL, (shape[1:],), execute, detail, dim0=shape[0])


def reducescatter_rows(dim0: int, size: int) -> list[int]:
    """Rows each rank receives: as even as possible, the first ranks take the remainder."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def reducescatter(ops: ArrayOps, x: Buffer, reduction: Reduction, call: Call) -> Future[Buffer]:
    """Reduce ``x`` across ranks and give each rank its block of rows."""
    op, shape = _start(ops, x, "reducescatter", call)
    backend = op.backend
    if not shape:
        raise ConfigurationError(f"reducescatter {op.display!r} needs at least one dimension")
    reduction.check(op.dtype, op.display)
    prescale = reduction.prescale
    wire_op, post = reduction.on_wire(backend.size)
    rows = reducescatter_rows(shape[0], backend.size)

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

    op_name = reduction.op.name
    key = (shape, op_name, prescale, reduction.postscale)
    return op.submit(Kind.REDUCESCATTER, key, execute, f"shape {shape}, op={op_name}")


def barrier(blocking: bool = False, process_set: ProcessSet | None = None) -> Future[None]:
    """Negotiation alone synchronises every rank, so a barrier is one negotiation round."""
    engine = eng.require("barrier", process_set)
    return engine.submit(
        Request(Kind.BARRIER, "barrier", (Kind.BARRIER.name,), lambda a: None, "barrier"),
        blocking=blocking,
    )


def join(blocking: bool = False) -> Future[int]:
    """Resolve to the last rank to join once every rank has called ``join()``."""
    engine = eng.require("join")
    request = Request(Kind.JOIN, "join", (Kind.JOIN.name,), lambda a: None, "join")
    return engine.submit(request, blocking=blocking)


def allgather_object(obj: T, call: Call) -> Future[list[T]]:
    """Resolve to the list of every rank's ``obj`` (picklable), in rank order."""
    engine = eng.require("allgather_object", call.process_set)
    display = call.name or engine.auto_name("allgather_object")
    backend = engine.backend
    signature = (Kind.ALLGATHER_OBJECT.name, call.name)
    return engine.submit(
        Request(
            Kind.ALLGATHER_OBJECT,
            display,
            signature,
            lambda a: backend.allgather_object(obj),
            f"{display!r}",
        ),
        blocking=call.blocking,
    )


def broadcast_object(obj: T, root_rank: int, call: Call) -> Future[T]:
    """Resolve to ``root_rank``'s ``obj`` on every rank."""
    engine = eng.require("broadcast_object", call.process_set)
    display = call.name or engine.auto_name("broadcast_object")
    backend = engine.backend
    root = _check_root(root_rank, backend.size, display, call.process_set)
    signature = (Kind.BROADCAST_OBJECT.name, call.name, root)
    return engine.submit(
        Request(
            Kind.BROADCAST_OBJECT,
            display,
            signature,
            lambda a: backend.broadcast_object(obj, root),
            f"{display!r} root_rank={root}",
        ),
        blocking=call.blocking,
    )


def _check_root(root_rank: int, size: int, name: str, process_set: ProcessSet | None = None) -> int:
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
