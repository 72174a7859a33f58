"""What the collective engine runs: :class:`Request`, one op.

Its :class:`Kind`, how it is fused with its neighbours (:class:`Fusion`) and what negotiation
tells it (:class:`Agreement`) are here too.

The API functions (:mod:`.ops`, :mod:`.allreduce`, :mod:`.process_sets`, :mod:`.adasum`) build
requests; :mod:`.engine` negotiates and runs them (:mod:`.negotiation` encodes their header).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from spark_estimators.collective.backends.base import ReduceOp

if TYPE_CHECKING:
    from spark_estimators.collective.runtime.futures import OpFuture


class Kind(enum.IntEnum):
    """The kinds of collective request; the number travels in the negotiation vector."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7
    ALLGATHER_OBJECT = 8
    BROADCAST_OBJECT = 9
    PROCESS_SET = 10


class Tuner(Protocol):
    """What the engine calls around each negotiation round (see :mod:`.autotune`)."""

    def stamp(self, vector: np.ndarray) -> np.ndarray:
        """The rank's vector with what it publishes (rank 0: the current settings)."""

    def settle(self, engine: object, vectors: np.ndarray) -> None:
        """After the round's gather (every rank, same vectors): apply, measure, decide.

        ``engine`` is the :class:`~.engine.Engine` (typed ``object``: no import cycle).
        """


# Ops a joined rank can take part in (it contributes zeros / nothing).
JOINABLE = (Kind.ALLREDUCE, Kind.BARRIER)


@dataclass(frozen=True)
class Agreement:
    """What negotiation tells an op: every rank's first dimension, and who has joined."""

    dim0s: list[int]
    joined: list[int]
    #: Every rank's inline payload (``uint8`` rows; zeros for joined ranks), or None.
    payloads: np.ndarray | None = None


@dataclass(slots=True)
class Fusion:
    """How an allreduce request is fused with the ones queued behind it.

    Requests with equal ``key`` (this process only: framework, dtype, device, reduction,
    scaling) may run as one: ``run(requests, agreement)`` reduces them together (each
    request's own data is its ``part``) and returns each request's result, in order. Requests
    of one repeated op may share one ``Fusion``. ``pack(requests, out)`` (optional) writes
    their (prescaled) data into the ``uint8`` array ``out``, as their inline payloads would be.
    """

    key: tuple[Hashable, ...]
    nbytes: int
    run: Callable[[Sequence[Request], Agreement], Sequence[object]]
    pack: Callable[[Sequence[Request], np.ndarray], None] | None = None


class Request:
    """One collective op, as submitted by an API function.

    ``signature`` must be equal on every rank; ``execute`` runs on the engine thread after
    negotiation. ``numel``/``dtype``/``device``/``wire_op`` describe the single flat reduction
    an allreduce performs, which is what a joined rank mirrors with zeros. ``inline`` (small
    allreduces) returns this rank's data as bytes to send inside the negotiation; ``fusion``
    (allreduces) says how it fuses with its queued neighbours, ``part`` is its own data for
    that. ``description`` (for errors and the timeline) may be given as ``detail``, the text
    after the quoted name, formatted only when someone reads it; ``signature_hash`` may be
    given when the caller knows it (an op repeated step after step).

    A plain class with slots. ``settles_itself``: the request is its own future (the engine
    makes none; see :class:`~spark_estimators.collective.runtime.allreduce.AllreduceOp`).
    """

    settles_itself = False

    __slots__ = ("kind", "name", "signature", "execute", "_description", "_detail", "numel",
                 "dtype", "device", "wire_op", "dim0", "inline", "fusion", "part", "future",
                 "queued_ns", "_hash")  # fmt: skip

    def __init__(
        self,
        kind: Kind,
        name: str,
        signature: tuple[object, ...],
        execute: Callable[[Agreement], object],
        description: str | None = None,
        numel: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        wire_op: ReduceOp = ReduceOp.SUM,
        dim0: int = 0,
        inline: Callable[[], np.ndarray] | None = None,
        fusion: Fusion | None = None,
        part: Any = None,
        detail: str = "",
        signature_hash: int | None = None,
    ) -> None:
        self.kind, self.name, self.signature, self.execute = kind, name, signature, execute
        self._description, self._detail = description, detail
        self.numel, self.dtype, self.device, self.wire_op = numel, dtype, device, wire_op
        self.dim0, self.inline, self.fusion, self.part = dim0, inline, fusion, part
        self._hash = signature_hash
        #: ``perf_counter_ns()`` when it entered the engine's queue (0: run without queueing).
        self.queued_ns = 0
        #: Set by :meth:`Engine.submit` (which returns it).
        self.future: OpFuture

    @property
    def description(self) -> str:
        """The op as errors and the timeline show it (name, dtype, shape...)."""
        if self._description is None:
            self._description = f"{self.name!r} {self._detail}"
        return self._description

    @property
    def signature_hash(self) -> int:
        """:func:`signature_hash` of the signature (computed once)."""
        if self._hash is None:
            self._hash = cached_signature_hash(self.signature)
        return self._hash

    def __repr__(self) -> str:
        return f"Request({self.kind.name}, {self.name!r})"


def cached_signature_hash(signature: tuple[object, ...]) -> int:
    """:func:`signature_hash`, remembered for hashable signatures (loops repeat them)."""
    try:
        found = _hash_cache.get(signature)
    except TypeError:  # an unhashable signature: no caching
        return signature_hash(signature)
    if found is None:
        found = signature_hash(signature)
        if len(_hash_cache) < _HASH_CACHE_SIZE:
            _hash_cache[signature] = found
    return found


# Training loops repeat the same ops step after step: hash each signature once.
_hash_cache: dict[tuple[object, ...], int] = {}
_HASH_CACHE_SIZE = 65536


def signature_hash(signature: tuple[object, ...]) -> int:
    """A stable signed 64-bit hash of a signature tuple (same on every rank and run)."""
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def claim_name(in_flight: set[str], request: Request) -> None:
    """Add ``request``'s name to the names in flight; ``ValueError`` if it is there already.

    A second op with the name of one still in flight is refused, as Horovod does (its
    ``*_duplicate_name_error`` tests); the engine frees the name when the op settles.
    """
    if request.name in in_flight:
        raise ValueError(
            f"{request.kind.name.lower()} {request.name!r}: an op with this name is still in "
            "flight on this rank; wait for it first (synchronize / wait) or give the new op "
            "another name"
        )
    in_flight.add(request.name)
