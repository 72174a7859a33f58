"""Hierarchical allreduce and allgather: inside each host first, one rank per host across hosts.

Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``HOROVOD_HIERARCHICAL_ALLGATHER`` (and
horovodrun's ``--hierarchical-allreduce`` / ``--hierarchical-allgather``). When ranks share
hosts, the flat ring sends every byte over the network from every rank; the hierarchical form
keeps most of the traffic inside the host and lets fewer ranks cross the network.

:class:`HierarchicalBackend` wraps the backend ``init()`` started and replaces only
``allreduce`` and ``allgather`` (every other method is the wrapped backend's). At start every rank
learns every rank's host (the host hash, ``SPARK_ESTIMATORS_HOSTNAME``) in one
``allgather_object``, and every rank creates the same subgroups in the same order:

* a *local* group per host (its ranks in rank order);
* when every host runs the same number ``L`` of ranks, ``L`` *cross* groups: the ``i``-th rank
  of every host (Horovod's ``cross_rank`` groups); otherwise one cross group of the first rank of
  each host (the host's *root*).

Allreduce on NCCL, homogeneous hosts, Sum: the buffer (padded to a multiple of ``L`` elements)
is reduce-scattered inside the host, each local rank allreduces its ``1/L`` share with its cross
group (all ``L`` cross groups at once, so every rank's link carries ``1/L`` of the data), and the
shares are allgathered inside the host (:attr:`HierarchicalBackend.scatter`). Otherwise (gloo
and mpi, whose reduce-scatter and allgather are slower than their allreduce; other layouts or
ops): allreduce inside the host, the roots allreduce across hosts, the root broadcasts inside
the host.

Allgather: allgather inside the host, the roots allgather the hosts' blocks across hosts, each
root broadcasts the whole result inside its host; rows are put back in rank order when hosts do
not hold contiguous ranks.

Exactness: integer sums, Min, Max and Product are exact whatever the order; float sums are
added in another order than the flat ring's, so they can differ from the flat result in the last
bits (they are equal bit for bit when every partial sum is exact, e.g. integer-valued floats).
Every rank gets the same result. ``Average`` is a sum scaled afterwards by the engine
(:attr:`native_average` is False), as on a backend without a native average.

Process sets: :meth:`subgroup` builds the same hierarchy over the set's ranks (every rank of the
job calls it, as the contract asks), so a set spanning hosts reduces hierarchically too.

The switches (:attr:`allreduce_on`, :attr:`allgather_on`) may change between ops, on every rank
at the same op: autotune (:mod:`spark_estimators.collective.runtime.autotune`) does that. With
one host, or one rank per host, there is nothing to gain and :func:`wrap` leaves the backend flat.

Test hook: ranks started on one machine become distinct hosts through their environment (set
``SPARK_ESTIMATORS_HOSTNAME``, ``..._LOCAL_RANK`` and friends per process, or
``SPARK_ESTIMATORS_HOST_HASH_SALT`` per executor, see DECISIONS.md); nothing here is test-only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from spark_estimators.collective.backends.base import Backend, Buffer, ReduceOp, T

logger = logging.getLogger(__name__)

#: dtypes whose reduce-scatter every backend runs natively (others go through the root path).
_SCATTER_DTYPES = frozenset({"float32", "float64", "int32", "int64", "uint8", "int8"})


def _dtype_name(buf: Buffer) -> str:
    return str(buf.dtype).removeprefix("torch.")


def _numel(buf: Buffer) -> int:
    return int(buf.size) if isinstance(buf, np.ndarray) else int(buf.numel())


def _empty_like(buf: Buffer, shape: tuple[int, ...], zero: bool = False) -> Buffer:
    if isinstance(buf, np.ndarray):
        return (np.zeros if zero else np.empty)(shape, dtype=buf.dtype)
    return buf.new_zeros(shape) if zero else buf.new_empty(shape)


def _concat(parts: Sequence[Buffer], like: Buffer) -> Buffer:
    if isinstance(like, np.ndarray):
        return np.concatenate([np.asarray(p) for p in parts])
    import torch

    return torch.cat([p if not isinstance(p, np.ndarray) else torch.from_numpy(p) for p in parts])


class Layout:
    """Which host each rank of a group is on, and the local and cross groups that follow."""

    def __init__(self, hosts: Sequence[str]) -> None:
        order = list(dict.fromkeys(hosts))
        #: Ranks of each host (in rank order), hosts in the order of their first rank.
        self.local_groups = [[r for r, h in enumerate(hosts) if h == host] for host in order]
        sizes = {len(g) for g in self.local_groups}
        #: Every host runs the same number of ranks.
        self.homogeneous = len(sizes) == 1
        per_host = min(sizes)
        count = per_host if self.homogeneous else 1
        #: Cross group i: the i-th rank of every host (only i = 0, the roots, if not homogeneous).
        self.cross_groups = [[g[i] for g in self.local_groups] for i in range(count)]
        self.hosts = list(hosts)

    @property
    def useful(self) -> bool:
        """More than one host, and some host with more than one rank."""
        return len(self.local_groups) > 1 and any(len(g) > 1 for g in self.local_groups)

    def subset(self, ranks: Sequence[int]) -> Layout:
        """The layout of a process set (``ranks`` of this group, sorted)."""
        return Layout([self.hosts[r] for r in ranks])


class HierarchicalBackend(Backend):
    """``inner`` with hierarchical allreduce/allgather (see the module docstring)."""

    def __init__(
        self,
        inner: Backend,
        layout: Layout,
        local: Backend,
        cross: Backend | None,
        *,
        allreduce_on: bool,
        allgather_on: bool,
    ) -> None:
        super().__init__(inner.topology, timeout=inner.timeout, start_timeout=inner.start_timeout)
        self.inner, self.layout, self.local, self.cross = inner, layout, local, cross
        self.name = inner.name  # type: ignore[misc]  # the instance's own name shadows the class's
        #: Whether allreduce / allgather currently take the hierarchical path.
        self.allreduce_on, self.allgather_on = allreduce_on, allgather_on
        #: Allreduce by reduce-scatter / cross allreduce / allgather (homogeneous hosts, Sum):
        #: NCCL only. Gloo's reduce-scatter and allgather of 64 MiB took 1.7x and 1.2x its whole
        #: allreduce here (bench/RESULTS.md, issue 46), so gloo and mpi take the roots' path.
        self.scatter = inner.name == "nccl"
        me = inner.rank
        self._host = next(i for i, g in enumerate(layout.local_groups) if me in g)
        # Hosts are ordered by their first rank: host blocks are rank order iff each is a range.
        self._contiguous = all(g == list(range(g[0], g[0] + len(g))) for g in layout.local_groups)

    def __getattr__(self, name: str) -> object:
        # Only for attributes the wrapper lacks (device, group, _mesh, ranks_of, ...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing: :func:`wrap` builds the wrapper from a started backend."""

    def shutdown(self) -> None:
        """Release the subgroups, then the wrapped backend."""
        for sub in (self.cross, self.local):
            if sub is not None:
                try:
                    sub.shutdown()
                except Exception as exc:  # a broken group must not stop the shutdown
                    logger.debug("releasing a hierarchical subgroup failed: %s", exc)
        self.inner.shutdown()

    def mpi_threads_supported(self) -> bool:
        """The wrapped backend's answer."""
        return self.inner.mpi_threads_supported()

    def subgroup(self, ranks: Sequence[int]) -> Backend | None:
        """A process set's backend, hierarchical too when the set spans hosts usefully."""
        return _build(self.inner, self.layout.subset(ranks), [int(r) for r in ranks],
                      self.allreduce_on, self.allgather_on)  # fmt: skip

    # -- the two hierarchical ops ------------------------------------------------------------
    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """Reduce ``buf`` in place: inside the host, across hosts, then shared in the host."""
        if not self.allreduce_on:
            self.inner.allreduce(buf, op)
            return
        flat = buf.reshape(-1)
        n = _numel(flat)
        per_host = len(self.layout.local_groups[self._host])
        if n == 0:
            return
        if (
            self.scatter
            and self.layout.homogeneous
            and per_host > 1
            and op is ReduceOp.SUM
            and _dtype_name(flat) in _SCATTER_DTYPES
            and n >= per_host
        ):
            self._scatter_reduce(flat, n, per_host, op)
            return
        self.local.allreduce(flat, op)
        if self._is_root():
            assert self.cross is not None  # a host's first rank is in the roots' group
            self.cross.allreduce(flat, op)
        self.local.broadcast(flat, 0)

    def _is_root(self) -> bool:
        return self.local.rank == 0

    def _scatter_reduce(self, flat: Buffer, n: int, per_host: int, op: ReduceOp) -> None:
        chunk = -(-n // per_host)
        if chunk * per_host == n:
            work = flat
        else:
            work = _empty_like(flat, (chunk * per_host,), zero=True)
            work[:n] = flat
        mine = self.local.reducescatter(work.reshape(per_host, chunk), op, [1] * per_host)
        assert self.cross is not None
        self.cross.allreduce(mine, op)
        gathered = self.local.allgather(mine, [1] * per_host)
        flat[:] = gathered.reshape(-1)[:n]

    def allgather(self, buf: Buffer, first_dims: Sequence[int]) -> Buffer:
        """Concatenate every rank's ``buf`` on dim 0, gathering inside hosts first."""
        if not self.allgather_on:
            return self.inner.allgather(buf, first_dims)
        groups = self.layout.local_groups
        mine = groups[self._host]
        block = self.local.allgather(buf, [first_dims[r] for r in mine])
        rest = tuple(buf.shape[1:])
        blocks = [sum(first_dims[r] for r in g) for g in groups]
        total = sum(blocks)
        if self._is_root():
            assert self.cross is not None
            whole = self.cross.allgather(block, blocks)
        else:
            whole = _empty_like(buf, (total, *rest))
        if total:
            self.local.broadcast(whole, 0)
        if self._contiguous:
            return whole
        # Host blocks -> rank order.
        starts: dict[int, int] = {}
        offset = 0
        for g in groups:
            for r in g:
                starts[r] = offset
                offset += first_dims[r]
        parts = [whole[starts[r] : starts[r] + first_dims[r]] for r in range(len(first_dims))]
        return _concat(parts, buf)

    # -- everything else is the wrapped backend's ----------------------------------------------
    def broadcast(self, buf: Buffer, root: int) -> None:
        """The wrapped backend's broadcast."""
        self.inner.broadcast(buf, root)

    def alltoall(self, buf: Buffer, send_rows: Sequence[int], recv_rows: Sequence[int]) -> Buffer:
        """The wrapped backend's alltoall."""
        return self.inner.alltoall(buf, send_rows, recv_rows)

    def barrier(self) -> None:
        """The wrapped backend's barrier."""
        self.inner.barrier()

    def reducescatter(self, buf: Buffer, op: ReduceOp, rows: Sequence[int]) -> Buffer:
        """The wrapped backend's reducescatter."""
        return self.inner.reducescatter(buf, op, rows)

    def gather_vectors(self, vector: np.ndarray) -> np.ndarray:
        """The wrapped backend's negotiation round."""
        return self.inner.gather_vectors(vector)

    def allgather_object(self, obj: T) -> list[T]:
        """The wrapped backend's object allgather."""
        return self.inner.allgather_object(obj)

    def broadcast_object(self, obj: T, root: int) -> T:
        """The wrapped backend's object broadcast."""
        return self.inner.broadcast_object(obj, root)

    def zeros(self, numel: int, dtype: str, device: str) -> Buffer:
        """The wrapped backend's zeros."""
        return self.inner.zeros(numel, dtype, device)


def _build(
    parent: Backend,
    layout: Layout,
    members: Sequence[int] | None,
    allreduce_on: bool,
    allgather_on: bool,
) -> Backend | None:
    """Create a group's subgroups on every rank of ``parent``; this rank's backend or None.

    ``members`` (ranks of ``parent``, sorted) is a process set, None the whole group. Every rank
    of ``parent`` creates the same subgroups in the same order.
    """
    outer = None if members is None else parent.subgroup(members)
    if members is not None and not layout.useful:
        return outer
    index = list(range(parent.size)) if members is None else list(members)
    local = cross = None
    for group in layout.local_groups:
        sub = parent.subgroup([index[r] for r in group])
        local = sub if sub is not None else local
    for group in layout.cross_groups:
        sub = parent.subgroup([index[r] for r in group])
        cross = sub if sub is not None else cross
    base = parent if members is None else outer
    if base is None or local is None:
        return None
    return HierarchicalBackend(
        base, layout, local, cross, allreduce_on=allreduce_on, allgather_on=allgather_on
    )


def wrap(backend: Backend, *, allreduce_on: bool, allgather_on: bool) -> Backend:
    """``backend`` with hierarchical ops when its ranks span hosts with several ranks on one.

    Called by every rank right after ``backend.start()``; returns ``backend`` itself when the
    layout gains nothing (one host, or one rank per host). Both switches off still wraps (so
    autotune can switch them on later); the ops then run flat.
    """
    hosts = backend.allgather_object(backend.topology.hostname)
    layout = Layout(hosts)
    if not layout.useful:
        logger.debug("hierarchical collectives: %d host(s), nothing to gain; flat", len(hosts))
        return backend
    wrapped = _build(backend, layout, None, allreduce_on, allgather_on)
    assert wrapped is not None
    return wrapped


__all__ = ["HierarchicalBackend", "Layout", "wrap"]
