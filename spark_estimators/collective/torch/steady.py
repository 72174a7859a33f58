"""``DistributedOptimizer``'s steady state: the last bucket reduced without a negotiation round.

A training loop reduces the same bucket of gradients step after step. Through the engine each
step pays a negotiation round (the op's vector, the data inline in it, the plan, the packing and
unpacking of the fused gradient, the request and its future): most of a small model's gradient
allreduce is that Python work, not the bytes (issue 45: ~0.4 ms of CPU a step for 50 KB on the
2-core machine, where a Unix socket moves them in ~20 us). Horovod skips its negotiation for ops
it has seen before (the response cache); this is the same idea for the optimizer's last bucket.

When it applies: every rank on this host connected by the local mesh
(:meth:`~spark_estimators.collective.backends.base.Backend.local_mesh`), the bucket on the CPU
in a numpy dtype, dense gradients, ``Compression.none`` or ``fp16``, op ``Average`` or ``Sum``,
the bucket small enough to travel inline (``settings.inline_limit``), no autotune, and
``SPARK_ESTIMATORS_STEADY_ALLREDUCE`` not ``0``. Elsewhere (other hosts, NCCL, MPI,
hierarchical, a process set's subgroup, Adasum) the optimizer takes the engine's path as before.

How: the first step of an optimizer goes through the engine (negotiated, so ranks with other
models fail there with the usual mismatch error). From the second, ``synchronize()`` takes the
engine's execution lock, runs whatever ops are still queued (those submitted before this one),
copies the gradients into a wire buffer kept for the bucket (cast to float16 with
``fp16``, times ``gradient_predivide_factor``'s prescale), and exchanges it with every rank in
one mesh round tagged with a hash of the bucket (names, shapes, dtypes, op, scale factors).
Every rank sums the rows in rank order with the engine's own inline reduction, so the result is
bit for bit what the engine's inline path gives, then copies it back into the gradients.

A rank that is not in the same place (one that called ``join()``, negotiates another op, or
has another bucket, hence another tag) makes the round *void* on every rank (see
:mod:`~spark_estimators.collective.backends.local_mesh`): the ranks of the steady round fall
back to the engine's path for this step, where a real mismatch raises the usual error and a
joined rank contributes zeros as in Horovod. They try again after a back-off of 64 rounds of
the mesh, doubling for each void in a row (``LocalMesh.due``): every rank counts the same
rounds, so ranks whose steps differ (after ``join()``) still try in the same rounds. A peer that
dies or stays silent fails the round as any collective op: the group is broken and a
:class:`~spark_estimators.errors.CollectiveError` says what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from operator import attrgetter, is_

import numpy as np
import torch

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import FLOATING_DTYPES, ReduceOp
from spark_estimators.collective.backends.local_mesh import HEADER_BYTES, LocalMesh
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import settings as _settings
from spark_estimators.collective.runtime.allreduce import Reduction, finish_rows
from spark_estimators.collective.runtime.arrays import scale_array
from spark_estimators.collective.runtime.process_sets import ProcessSet
from spark_estimators.collective.runtime.requests import signature_hash
from spark_estimators.collective.torch.compression import Compression, Compressor
from spark_estimators.errors import CollectiveError

_NUMPY = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
_GRAD = attrgetter("grad")


class SteadyBucket:
    """The steady-state exchange of one bucket (the optimizer's last) of one optimizer.

    ``taken`` counts the steps reduced here, ``voided`` the tries that fell back.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        name: str,
        names: Sequence[str],
        op: ReduceOp,
        pre: float,
        post: float,
        compression: type[Compressor],
        process_set: ProcessSet | None,
    ) -> None:
        self.params = list(params)
        self.param_ids = frozenset(id(p) for p in self.params)
        self.name = name
        self._reduction = Reduction(op, pre, post)
        self._compression = compression
        self._process_set = process_set
        dtype = self.params[0].dtype
        self._wire_dtype = torch.float16 if compression is Compression.fp16 else dtype
        self.numel = sum(int(p.numel()) for p in self.params)
        self.nbytes = self.numel * torch.empty((), dtype=self._wire_dtype).element_size()
        self._signature = (
            "DistributedOptimizer.steady",
            tuple(names),
            tuple(tuple(p.shape) for p in self.params),
            str(dtype),
            str(self._wire_dtype),
            op.name,
            float(pre),
            float(post),
        )
        self.taken = 0
        self.voided = 0
        self._engine: _engine.Engine | None = None
        self._armed = False  # the engine's path reduced this bucket once on self._engine
        self._usable = False  # eligible() on self._engine's group, and the bucket fits inline
        self._wire: Wire | None = None

    def eligible(self) -> bool:
        """What does not change between steps: device, dtype, compression, op, size, switch."""
        p0 = self.params[0]
        return (
            ev.env_on(ev.STEADY_ALLREDUCE)
            and p0.device.type == "cpu"
            and self._wire_dtype in _NUMPY
            and all(p.dtype == p0.dtype and p.device == p0.device for p in self.params)
            and self._compression in (Compression.none, Compression.fp16)
            and self._reduction.op in (ReduceOp.AVERAGE, ReduceOp.SUM)
            and self.nbytes > 0
        )

    def negotiated(self) -> None:
        """The engine's path reduced the bucket this step: later steps may skip negotiation."""
        self._armed = True

    def run(self) -> bool:
        """Reduce the bucket's gradients in place; False: take the engine's path this step."""
        engine = _engine.require("DistributedOptimizer", self._process_set)
        if engine is not self._engine:  # first step, or a new init(): negotiate once again
            self._engine, self._armed, self._wire = engine, False, None
            fits = self.nbytes <= max(_settings.inline_limit(engine.backend.size), 512)
            self._usable = fits and self.eligible() and engine.backend.local_mesh() is not None
            return False
        if not (self._armed and self._usable) or engine.tuner is not None:
            return False
        wire = self._wire
        if wire is None:
            mesh = engine.backend.local_mesh()
            if mesh is None:
                return False
            wire = self._wire = Wire(self, engine, mesh)
        own = wire.holds_gradients()
        grads: list[torch.Tensor] = []
        if not own:  # gradients autograd allocated (the first step, or set to None since)
            for p in self.params:
                if p.grad is None:  # not used this step here; other ranks may have a gradient
                    p.grad = torch.zeros_like(p)
                if p.grad.is_sparse:
                    return False
                grads.append(p.grad.detach())
            torch._foreach_copy_(wire.views, grads)
            if self._reduction.prescale != 1.0:
                scale_array(wire.typed, self._reduction.prescale)
        timeline = engine.timeline
        start = time.perf_counter_ns() if timeline is not None else 0
        # The mesh is the engine's: one round at a time, after the ops submitted before this one,
        # where every rank has seen the same rounds (the back-off is decided there, alike on all).
        # None: the group is broken (the engine's path raises its error).
        outcome = engine.run_exclusive(wire.attempt, wire.failed)
        if outcome != "taken":
            self.voided += outcome == "void"
            return False
        wire.reduce()
        if not own:
            torch._foreach_copy_(grads, wire.views)
        self.taken += 1
        if timeline is not None:
            info: dict[str, object] = {"dtype": wire.dtype, "steady": True}
            timeline.record(self.name, "ALLREDUCE", engine.set_id, start, start,
                            time.perf_counter_ns(), info)  # fmt: skip
        return True

    def lend_gradients(self) -> bool:
        """Make the wire's views the parameters' gradients, zeroed (``zero_grad()``'s default).

        Backward then adds into them in place and the next round sends them as they are: no
        copy into the wire and none back. Only where the wire carries the gradients' own bits
        (no ``fp16``, no prescale), once this optimizer has taken a steady round and has a wire
        on the current engine. False when it does not apply (the caller sets the gradients to
        None as torch does).
        """
        wire = self._wire
        if wire is None or not wire.lendable or not self.taken:
            return False
        wire.typed.fill(0)
        for p, view in zip(self.params, wire.views):
            if p.grad is not view:
                p.grad = view
        return True


class Wire:
    """The buffers of a bucket's steady rounds.

    What is sent (header room, then the payload), the rows received, one per rank, and a
    scratch row for sums that must start with another rank's row.
    """

    def __init__(self, bucket: SteadyBucket, engine: _engine.Engine, mesh: LocalMesh) -> None:
        rank, size = engine.backend.rank, engine.backend.size
        self.rank = rank
        self.dtype = _NUMPY[bucket._wire_dtype]  # noqa: SLF001
        tag = signature_hash(bucket._signature) & ((1 << 63) - 1)  # noqa: SLF001
        self.tag = tag or 1
        raw = np.zeros(HEADER_BYTES + bucket.nbytes, dtype=np.uint8)
        self.message = memoryview(raw.data)
        self.payload = raw[HEADER_BYTES:]
        self.typed = self.payload.view(self.dtype)
        flat = torch.from_numpy(self.typed)
        self.views = [
            v.view(p.shape)
            for v, p in zip(flat.split([int(p.numel()) for p in bucket.params]), bucket.params)
        ]
        self._params = bucket.params
        self.rows = np.zeros((size, bucket.nbytes), dtype=np.uint8)
        self.into = {r: memoryview(self.rows[r]) for r in range(size) if r != rank}
        self.peers = {r: self.rows[r].view(self.dtype) for r in self.into}
        self.scratch = np.empty_like(self.typed) if size > 2 and rank > 0 else None
        # the views may be the gradients: the wire carries their own bits (on the CPU, as
        # every bucket with a wire: SteadyBucket.eligible)
        self.lendable = (
            bucket._wire_dtype == bucket.params[0].dtype  # noqa: SLF001
            and bucket._reduction.prescale == 1.0  # noqa: SLF001
        )
        reduction = bucket._reduction  # noqa: SLF001
        native = (
            reduction.op is ReduceOp.AVERAGE
            and engine.backend.native_average
            and reduction.prescale == reduction.postscale == 1.0
            and self.dtype in FLOATING_DTYPES
        )
        wire_op, post = reduction.on_wire(size, native)
        #: every rank's row reduced into this rank's (``typed``), in place, after a round
        self.reduce = row_reducer(self.typed, self.peers, rank, self.scratch, wire_op, post)
        self._mesh = mesh
        name = bucket.name
        self.failed: Callable[[BaseException], CollectiveError] = lambda exc: _failed(
            name, engine, exc
        )

    def attempt(self) -> str:
        """One steady round, under the engine's lock: ``taken``, ``void`` or ``later``."""
        if not self._mesh.due(self.tag):
            return "later"
        return "taken" if self._mesh.exchange(self.tag, self.message, self.into) else "void"

    def holds_gradients(self) -> bool:
        """Whether every parameter's gradient is this wire's view (lent by ``zero_grad()``)."""
        return self.lendable and all(map(is_, map(_GRAD, self._params), self.views))


def reduce_rows_into(
    own: np.ndarray,
    peers: dict[int, np.ndarray],
    rank: int,
    scratch: np.ndarray | None,
    op: ReduceOp,
    post: float,
) -> None:
    """``own`` (this rank's row) becomes the reduction of every rank's row, in place.

    The bits of the engine's inline reduction
    (:func:`~spark_estimators.collective.runtime.allreduce._reduce_rows`): the rows added in
    rank order, one after the other (with two ranks, ``b + a`` is ``a + b`` bit for bit, so the
    other row is added to this one), then the native average's division or the post factor.
    ``op``: ``SUM`` or ``AVERAGE``; ``scratch``: a row of ``own``'s dtype, needed when there are
    more than two ranks and this is not rank 0.
    """
    if len(peers) == 1 or rank == 0:
        for r in sorted(peers):
            np.add(own, peers[r], out=own)
    else:
        assert scratch is not None
        np.add(peers[0], own if rank == 1 else peers[1], out=scratch)
        for r in range(2, len(peers) + 1):
            np.add(scratch, own if r == rank else peers[r], out=scratch)
        own[...] = scratch
    finish_rows(own, op, len(peers) + 1, post)


def row_reducer(
    own: np.ndarray,
    peers: dict[int, np.ndarray],
    rank: int,
    scratch: np.ndarray | None,
    op: ReduceOp,
    post: float,
) -> Callable[[], None]:
    """:func:`reduce_rows_into` of these buffers as one call, planned once for every round.

    Two ranks in float32/float64 (most steady rounds) take two ufunc calls with the factor
    ready; anything else calls :func:`reduce_rows_into`. The same bits either way.
    """
    general = (
        len(peers) != 1
        or own.dtype not in (np.float32, np.float64)
        or op not in (ReduceOp.SUM, ReduceOp.AVERAGE)
        or (op is ReduceOp.AVERAGE and post != 1.0)
    )
    if general:
        return lambda: reduce_rows_into(own, peers, rank, scratch, op, post)
    (peer,) = peers.values()
    cast = own.dtype.type
    ufunc: np.ufunc | None = None
    factor = cast(1)
    if op is ReduceOp.AVERAGE:  # the native average: a division by the rank count
        ufunc, factor = np.divide, cast(2)
    elif post != 1.0:
        ufunc, factor = np.multiply, cast(post)

    def reduce() -> None:
        np.add(own, peer, out=own)
        if ufunc is not None:
            ufunc(own, factor, out=own)

    return reduce


def _failed(name: str, engine: _engine.Engine, exc: BaseException) -> CollectiveError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = "a peer rank probably died or stopped calling collectives; check its log"
    if isinstance(exc, TimeoutError):
        hint = (
            f"no peer answered within the collective timeout ({engine.backend.timeout:g} s, "
            f"{ev.COLLECTIVE_TIMEOUT})"
        )
    return CollectiveError(
        f"allreduce {name!r} (steady state, over the local mesh) failed on rank "
        f"{engine.backend.rank}: {text}; {hint}"
    )
