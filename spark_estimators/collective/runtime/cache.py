"""The response cache: a batch of allreduces run before runs again without a negotiation round.

A training loop (``allreduce_async_`` per gradient, then ``synchronize``; a grouped allreduce
per step) submits the same batch of allreduces step after step. Through the negotiation each
round builds and gathers a vector listing every op, plans the agreed batch, packs a fresh fused
buffer and reduces it with the backend (Gloo's ring for a batch too large to travel inline:
~2.5 ms for 100 x 4 KiB on the 2-core machine, most of the round). Horovod keeps a response
cache for ops it has negotiated before and agrees on them with a bit vector; this is our own
take on the idea for ranks of one host.

What is cached: after a negotiated round of allreduces that every rank took part in (nobody
joined) on CPU data in a numpy dtype, the batch that ran is remembered under the tuple of its
requests' signature hashes (names, dtypes, shapes, reduction, scaling: what the negotiation
compares), with a tag (a hash of that tuple) and persistent buffers. At most :func:`capacity`
batches and :data:`MOST_BYTES` of buffers (least recently used first out).

A cached round: when the engine's next batch is one of those, the rank exchanges it over the
local mesh (:meth:`~spark_estimators.collective.backends.local_mesh.LocalMesh.exchange`) under
the batch's tag, in one of two ways fixed when the batch was learnt:

* *data*: the batch's packed (prescaled) data travels in the round itself and every rank
  reduces the rows in rank order with the engine's inline reduction. Used when that gives the
  bits of the negotiated path: the batch travels inline there (it fits the ranks' inline
  limit), or it is exact in any order (2 ranks, min/max, integers) and at most
  :data:`DATA_BYTES` per peer.
* *tag*: only the tag travels; the batch then runs as the negotiated path runs it (one fused
  buffer through the backend).

The mesh makes a round in which the ranks' tags differ *void* on every rank: a rank whose batch
is another one, or one not cached there, one that negotiates (its next op is another, it
called ``join()``) all turn it void, and every rank then negotiates the batch as before, where a
mismatch raises the usual error and a joined rank contributes zeros. After a void the batch's
next tries are skipped on every rank for a back-off (the negotiation that follows sets it, see
:meth:`ResponseCache.learn`; doubling up to :data:`MOST_BACKOFF` rounds). A peer that
dies or stays silent fails the round like any backend error (the group is broken). The cache is
off without a local mesh (ranks on several hosts, MPI, a process set's subgroup), while
autotune runs, and with ``SPARK_ESTIMATORS_STEADY_ALLREDUCE=0`` or ``HOROVOD_CACHE_CAPACITY=0``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import DTYPES, Backend, ReduceOp
from spark_estimators.collective.backends.local_mesh import HEADER_BYTES
from spark_estimators.collective.runtime.negotiation import itemsize
from spark_estimators.collective.runtime.requests import Agreement, Kind, Request, signature_hash
from spark_estimators.errors import ConfigurationError

#: Most batches remembered, unless ``HOROVOD_CACHE_CAPACITY`` says otherwise (:func:`capacity`).
CAPACITY = 64
#: Most bytes of buffers the remembered batches hold together.
MOST_BYTES = 64 << 20
#: Most bytes a data round sends to each peer (larger batches take the tag round).
DATA_BYTES = 8 << 20
#: Rounds a batch skips the cache after it was negotiated again (doubled each time, up to
#: MOST_BACKOFF; back to this after a round taken from the cache).
BACKOFF = 4
#: Cycle times the engine waits for the rest of a cached batch (:meth:`ResponseCache.patience`).
PATIENCE = 20
MOST_BACKOFF = 1024
_EXACT_OPS = (ReduceOp.MIN, ReduceOp.MAX)
_NUMPY_DTYPES = frozenset(d for d in DTYPES if d != "bfloat16")


def capacity() -> int:
    """Most batches the cache keeps.

    ``HOROVOD_CACHE_CAPACITY`` (Horovod's knob; ``0`` turns the cache off), else :data:`CAPACITY`.
    """
    name = ev.HOROVOD_CACHE_CAPACITY
    problem = (
        f"{name}={os.environ.get(name)!r} must be a whole number >= 0 (the response cache's "
        "most batches; 0 turns it off)"
    )
    try:
        value = ev.env_int(name, CAPACITY)
    except ValueError as exc:
        raise ConfigurationError(problem) from exc
    if value < 0:
        raise ConfigurationError(problem)
    return value


class _Entry:
    """One remembered batch: its tag, how it travels and its buffers."""

    __slots__ = ("tag", "data", "message", "payload", "rows", "into", "next_try", "backoff")

    def __init__(self, key: tuple[int, ...], data: bool, nbytes: int, rank: int, size: int):
        length = nbytes if data else 8
        # How it travels is part of the tag: a round of another length is never read as this.
        described = ("response cache", data, length, *key)
        self.tag = (signature_hash(described) & ((1 << 63) - 1)) or 1
        self.data = data
        raw = np.zeros(HEADER_BYTES + length, dtype=np.uint8)
        self.message = memoryview(raw.data)
        self.payload = raw[HEADER_BYTES:]
        self.rows = np.zeros((size, length), dtype=np.uint8)
        self.into = {r: memoryview(self.rows[r]) for r in range(size) if r != rank}
        self.next_try = 0  # the engine's negotiation round from which the batch is tried again
        self.backoff = BACKOFF

    @property
    def nbytes(self) -> int:
        return len(self.message) + int(self.rows.nbytes)


class ResponseCache:
    """The batches of allreduces one engine negotiated before (see the module docstring).

    ``taken`` counts the rounds run from the cache, ``voided`` the tries that fell back.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.capacity = capacity()
        self.taken = 0
        self.voided = 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._bytes = 0
        # (length, chained hash) of every proper prefix of a cached batch / of the batches.
        self._prefixes: dict[tuple[int, int], int] = {}
        self._whole: dict[tuple[int, int], int] = {}

    @staticmethod
    def wanted(backend: Backend) -> bool:
        """True when ``backend``'s group has a local mesh and neither switch turns it off."""
        if backend.local_mesh() is None or not ev.env_on(ev.STEADY_ALLREDUCE):
            return False
        return capacity() > 0

    def run(self, batch: Sequence[Request], round_: int) -> Sequence[object] | None:
        """Run ``batch`` from the cache; None when it is not cached or the round was void.

        ``round_``: the engine's negotiation rounds so far (the same on every rank at this
        point, see :meth:`learn`). The caller holds the engine's execution lock; an exception (a
        peer died, the timeout) breaks the group, as one from the backend does.
        """
        entries = self._entries
        head, rank = batch[0], self.backend.rank
        fusion = head.fusion
        if not entries or fusion is None or fusion.pack is None:
            return None
        key = tuple([r.signature_hash for r in batch])
        entry = entries.get(key)
        mesh = self.backend.local_mesh()
        if entry is None or mesh is None or round_ < entry.next_try:
            return None
        if entry.data:
            fusion.pack(batch, entry.payload)
        if not mesh.exchange(entry.tag, entry.message, entry.into):
            self.voided += 1  # every rank now negotiates; learn() sets the back-off on all
            return None
        self.taken += 1
        entry.backoff = BACKOFF  # a taken round is taken on every rank: the same on all
        entries.move_to_end(key)
        payloads = None
        if entry.data:
            entry.rows[rank] = entry.payload
            payloads = entry.rows
        agreement = Agreement(dim0s=[head.dim0] * self.backend.size, joined=[], payloads=payloads)
        if len(batch) == 1:
            return [head.execute(agreement)]
        return fusion.run(batch, agreement)

    def patience(self, pending: Sequence[Request], cycle_time: float) -> float:
        """Seconds more to wait when ``pending`` starts a longer cached batch (else 0).

        A burst of ``allreduce_async_`` calls that the caller's thread could not submit within
        one cycle time (it was descheduled) would otherwise run as a part, negotiated, and
        the rest as another part: wait for the rest instead, up to ``PATIENCE`` cycle times
        after the last submission (a waiter or a poll ends the wait at once).
        """
        starts, chain = self._prefixes, 0
        for n, request in enumerate(pending, 1):
            chain = hash((chain, request.signature_hash))
            if (n, chain) not in starts:
                return 0.0
        return PATIENCE * cycle_time if (len(pending), chain) not in self._whole else 0.0

    def learn(
        self, ran: Sequence[Request], agreement: Agreement, inline_limit: int, round_: int
    ) -> None:
        """Remember ``ran``, a batch the ranks just negotiated and ran, if it can be cached.

        ``inline_limit``: the ranks' largest inline batch (the negotiated path sends a repeated
        batch up to it inline from its second round on, see :mod:`.negotiation`). ``round_``:
        the engine's negotiation rounds before this batch's, as given to :meth:`run`.

        Every rank calls this with the same batch and round (the negotiation agreed on them),
        so the back-off it sets is the same on every rank. A cached batch negotiated again while
        it could have been tried (a try was void, or a rank did not try it) is not tried for
        the next ``backoff`` rounds, doubling each time, up to :data:`MOST_BACKOFF`. Set in
        :meth:`run` from a void try, the back-off would differ between the ranks that tried and
        those that did not, and their tries would never meet again.
        """
        head = ran[0]
        fusion = head.fusion
        if (
            agreement.joined
            or head.kind is not Kind.ALLREDUCE
            or fusion is None
            or fusion.pack is None
            or head.device != "cpu"
            or head.dtype not in _NUMPY_DTYPES
        ):
            return
        key = tuple([r.signature_hash for r in ran])
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if round_ >= entry.next_try:
                entry.next_try = round_ + 1 + entry.backoff
                entry.backoff = min(2 * entry.backoff, MOST_BACKOFF)
            return
        size = self.backend.size
        nbytes = sum(r.numel for r in ran) * itemsize(head.dtype)
        exact = size == 2 or head.wire_op in _EXACT_OPS or head.dtype[0] in "iub"
        inline = agreement.payloads is not None or nbytes <= inline_limit
        data = inline or (exact and nbytes <= DATA_BYTES)
        if size * nbytes > MOST_BYTES // 4:
            data = False
        entry = _Entry(key, data, nbytes, self.backend.rank, size)
        self._entries[key] = entry
        self._bytes += entry.nbytes
        self._count(key, 1)
        while len(self._entries) > self.capacity or self._bytes > MOST_BYTES:
            old_key, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._count(old_key, -1)

    def _count(self, key: tuple[int, ...], delta: int) -> None:
        """Add (or remove) ``key``'s prefixes to the ones :meth:`patience` knows."""
        chain = 0
        for n, signature in enumerate(key, 1):
            chain = hash((chain, signature))
            table = self._whole if n == len(key) else self._prefixes
            left = table[n, chain] = table.get((n, chain), 0) + delta
            if left <= 0:
                del table[n, chain]
