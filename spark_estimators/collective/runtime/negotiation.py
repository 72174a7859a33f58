"""The negotiation vector: what every rank sends before each round of collective ops.

Before each round the ranks allgather one int64 vector each (see
:mod:`~spark_estimators.collective.runtime.engine` for why). Its layout::

    header (HEADER_LEN)  |  slots: signature hashes, then element counts (2 x slots)  |  payload

* The header describes the rank's *head* request (the oldest one it has not run yet): kind,
  signature hash, first dimension, what a joined rank needs to mirror an allreduce, how many
  requests follow in the slots, and the rank's wishes for the next rounds' sizes.
* The slots list the rank's *fusion batch*: the head and the queued allreduces right behind it
  that it may fuse with it (same dtype, device, reduction and scaling, within the fusion
  threshold), in submission order.
* The payload carries the data of the batch when the whole batch fits (inline allreduce: one
  round trip instead of two).

What runs is decided from the gathered vectors only, so every rank decides the same: the
**agreed batch** is the longest prefix of the head's batch that every active (not joined) rank
listed with the same signatures in the same positions. Ranks whose queues differ (one rank's
cycle ended earlier, or its fusion threshold is smaller) simply fuse fewer requests this round;
the rest become the head of the next round. Ranks that submitted different ops, or the same ops
in a different order, disagree on the head, and the engine raises a mismatch error on every rank
instead of hanging.

The sizes of the slots and the payload are the same on every rank (the allgather needs equal
lengths): each round's vectors carry every rank's wishes, and every rank computes the next sizes
from them alone. The payload room follows the largest inline-able batch of the last
``ROOM_WINDOW`` rounds (at least ``INLINE_BYTES``, at most the inline limit); the slot count
follows the longest batch of the last ``ROOM_WINDOW`` rounds that had more than one op to fuse
(``MIN_SLOTS`` .. ``MAX_SLOTS``), so blocking ops between two training steps do not shrink it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators.collective.backends.base import DTYPES, Backend, ReduceOp, dtype_code
from spark_estimators.collective.runtime.requests import Kind
from spark_estimators.errors import CollectiveError

if TYPE_CHECKING:
    from spark_estimators.collective.runtime.requests import Request

# Header fields. TUNE..TUNE_FLAGS: the settings autotune's rank 0 publishes (runtime/autotune.py).
KIND, SIG, JOINED, DIM0, NUMEL, DTYPE, WIRE_OP, DEVICE, INLINE, WANT, LIMIT, COUNT, SLOTS_WANT = (
    range(13)
)
TUNE, TUNE_FUSION, TUNE_CYCLE_US, TUNE_FLAGS = range(13, 17)
HEADER_LEN = 17
#: The fixed payload room: an allreduce of at most this many bytes always travels inline.
INLINE_BYTES = 512
#: The room and the slot count follow the wishes of this many recent rounds.
ROOM_WINDOW = 32
#: Fewest and most requests one round can fuse (the slot count lies in between).
MIN_SLOTS = 64
MAX_SLOTS = 1024
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Plan:
    """What a round runs, computed from the gathered vectors (the same on every rank)."""

    #: Requests of the head's batch that run now, fused (1: the head alone).
    count: int
    #: Whether the data of those requests travelled inside the vectors.
    inline: bool
    #: Elements reduced by the agreed batch (what a joined rank mirrors with zeros).
    numel: int


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (numpy has no bfloat16)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = 2 if dtype == "bfloat16" else int(np.dtype(dtype).itemsize)
    return size


_ITEMSIZES: dict[str, int] = {}


class Negotiation:
    """Builds this rank's vectors and reads the gathered ones; keeps the agreed sizes."""

    def __init__(self, limit: int) -> None:
        #: Largest inline batch (bytes per rank) this rank accepts (sent in every header).
        self.limit = limit
        #: Bytes of payload room in the next vector (a multiple of 8).
        self.room = INLINE_BYTES
        #: Requests the next vector can list.
        self.slots = MIN_SLOTS
        #: The smallest limit of the last round's ranks: repeated batches up to it go inline.
        self.agreed_limit = limit
        self._room_wants: deque[int] = deque(maxlen=ROOM_WINDOW)
        self._slot_wants: deque[int] = deque(maxlen=ROOM_WINDOW)
        # The slot count of the vectors of the round in flight: update() may change
        # ``slots`` before plan() and payloads() read that round's vectors.
        self._sent_slots = self.slots

    @property
    def payload_offset(self) -> int:
        """Index of the payload's first int64 in the vectors of the round in flight."""
        return HEADER_LEN + 2 * self._sent_slots

    def empty(self) -> np.ndarray:
        """A vector with no request (what a joined rank sends); starts a round."""
        self._sent_slots = self.slots
        vector = np.zeros(self.payload_offset + self.room // 8, dtype=np.int64)
        vector[LIMIT] = self.limit
        return vector

    def vector(self, batch: Sequence[Request]) -> np.ndarray:
        """The vector of this rank for ``batch`` (the head first, then what it may fuse with)."""
        head = batch[0]
        listed = batch[: self.slots]
        vector = self.empty()
        vector[KIND] = int(head.kind)
        vector[SIG] = head.signature_hash
        vector[JOINED] = -1
        vector[DIM0] = head.dim0
        vector[NUMEL] = head.numel
        vector[DTYPE] = dtype_code(head.dtype)
        vector[WIRE_OP] = int(head.wire_op)
        vector[DEVICE] = DEVICES.index(head.device) if head.device in DEVICES else 0
        vector[COUNT] = len(listed)
        vector[SLOTS_WANT] = min(len(batch), MAX_SLOTS)
        n = len(listed)
        vector[HEADER_LEN : HEADER_LEN + n] = [r.signature_hash for r in listed]
        vector[HEADER_LEN + self.slots : HEADER_LEN + self.slots + n] = [r.numel for r in listed]
        if head.inline is not None:
            sizes = [r.numel * itemsize(r.dtype) for r in listed]
            vector[WANT] = want = sum(sizes)
            # Only a listed batch that fits whole travels inline: packing the part that fits
            # would pay a copy per op every round for the rare round whose agreed batch is
            # shorter than this rank's (the room can be larger than the next batches need).
            if want <= self.room:
                room = vector[self.payload_offset :].view(np.uint8)
                used = packed = 0
                for request, nbytes in zip(listed, sizes, strict=True):
                    if request.inline is None:
                        break
                    room[used : used + nbytes] = np.asarray(request.inline(), dtype=np.uint8)
                    used += nbytes
                    packed += 1
                vector[INLINE] = packed
        return vector

    def payloads(self, vectors: np.ndarray) -> np.ndarray:
        """Every rank's payload as ``uint8`` rows."""
        return np.ascontiguousarray(vectors[:, self.payload_offset :]).view(np.uint8)

    def plan(self, vectors: np.ndarray, active: Sequence[int]) -> Plan:
        """The agreed batch of this round (see the module docstring)."""
        rows = vectors[list(active)]
        count = int(rows[:, COUNT].min())
        hashes = rows[:, HEADER_LEN : HEADER_LEN + count]
        same = (hashes == hashes[0]).all(axis=0)
        if not same.all():
            count = int(np.argmin(same))
        inline = count > 0 and int(rows[:, INLINE].min()) >= count
        start = HEADER_LEN + self._sent_slots
        numel = int(rows[0, start : start + count].sum())
        return Plan(count=count, inline=inline, numel=numel)

    def update(self, vectors: np.ndarray) -> None:
        """Set the next round's sizes from this round's vectors (the same on every rank)."""
        limit = self.agreed_limit = int(vectors[:, LIMIT].min())
        wants = [int(w) for w in vectors[:, WANT] if 0 < w <= limit]
        self._room_wants.append(max(wants, default=0))
        self.room = max(INLINE_BYTES, -(-max(self._room_wants) // 8) * 8)
        wanted = int(vectors[:, SLOTS_WANT].max())
        if wanted > 1:  # rounds of single ops (blocking ones, metrics) leave the slots as they are
            self._slot_wants.append(wanted)
            self.slots = min(MAX_SLOTS, max(MIN_SLOTS, max(self._slot_wants)))


def fusion_batch(pending: Sequence[Request], threshold: int) -> list[Request]:
    """The head of ``pending`` and the queued requests right behind it it may be fused with."""
    head = pending[0]
    fusion = head.fusion
    batch = [head]
    if fusion is None or threshold <= 0:
        return batch
    total = fusion.nbytes
    for request in itertools.islice(pending, 1, MAX_SLOTS):
        other = request.fusion
        if other is None or other.key != fusion.key or total + other.nbytes > threshold:
            break
        batch.append(request)
        total += other.nbytes
    return batch


def can_grow(pending: Sequence[Request], threshold: int) -> bool:
    """True when one more queued request could still join the head's batch."""
    fusion = pending[0].fusion
    if fusion is None or threshold <= 0:
        return False
    batch = fusion_batch(pending, threshold)
    if len(batch) < len(pending) or len(batch) >= MAX_SLOTS:
        return False  # the batch already ends at a request that cannot join it
    return sum(r.fusion.nbytes for r in batch if r.fusion) < threshold


def active_ranks(vectors: np.ndarray) -> list[int]:
    """The ranks of a round's gathered vectors that have not joined."""
    return [r for r in range(vectors.shape[0]) if vectors[r, JOINED] < 0]


def agree(vectors: np.ndarray, active: Sequence[int]) -> bool:
    """True when the ``active`` ranks sent the same head op (kind and signature hash)."""
    first = vectors[active[0]]
    return all(vectors[r, KIND] == first[KIND] and vectors[r, SIG] == first[SIG] for r in active)


def mismatch_error(name: str, views: Sequence[tuple[str, str] | None]) -> CollectiveError:
    """The error every rank raises when the ranks disagree on an op.

    ``views`` holds each rank's op kind and description, None for a joined rank.
    """
    lines = [
        f"  rank {r}: " + ("join()" if view is None else f"{view[0]} {view[1]}")
        for r, view in enumerate(views)
    ]
    return CollectiveError(
        f"mismatched collective op for {name!r} across ranks (nothing was exchanged; every "
        "rank raises this error):\n"
        + "\n".join(lines)
        + "\nEvery rank must call the same ops in the same order with the same names, dtypes "
        "and shapes (allgather/alltoall may differ in the first dimension)."
    )


def join_rounds(
    joined_at: int,
    negotiation: Negotiation,
    negotiate: Callable[[np.ndarray], np.ndarray],
    mismatch: Callable[[np.ndarray], None],
    backend: Backend,
) -> int:
    """The rounds of a rank that called ``join()``, until every rank has; the last to join.

    Each round it negotiates a JOIN vector (``joined_at``: its round when it joined) and takes
    part in what the active ranks agreed: zeros for an allreduce that does not travel inline,
    the descriptions exchange of a mismatch (``mismatch``). The last to join has the highest
    join round (ties: the highest rank).
    """
    while True:
        vector = negotiation.empty()
        vector[KIND] = int(Kind.JOIN)
        vector[JOINED] = joined_at
        vectors = negotiate(vector)
        active = active_ranks(vectors)
        if not active:
            return max(range(vectors.shape[0]), key=lambda r: (vectors[r, JOINED], r))
        if not agree(vectors, active):
            mismatch(vectors)
            continue
        row = vectors[active[0]]
        plan = negotiation.plan(vectors, active)
        # An inline batch came with the negotiation: nothing more to take part in.
        if Kind(int(row[KIND])) is Kind.ALLREDUCE and plan.numel > 0 and not plan.inline:
            zeros = backend.zeros(plan.numel, DTYPES[int(row[DTYPE])], DEVICES[int(row[DEVICE])])
            backend.allreduce(zeros, ReduceOp(int(row[WIRE_OP])))
