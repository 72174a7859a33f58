"""Gloo and NCCL backends over ``torch.distributed`` (torch is imported inside methods only).

* ``gloo``: one Gloo process group; numpy buffers are wrapped zero-copy with ``torch.from_numpy``.
* ``nccl``: one process group with two backends, ``"cpu:gloo,cuda:nccl"``: CUDA tensors go
  through NCCL, CPU tensors and numpy buffers (negotiation, objects) through Gloo. The rank's
  device is its own GPU (``spark_estimators.task.get_device()``: its Spark address's place in
  ``CUDA_VISIBLE_DEVICES``, which is ``cuda:local_rank`` on the usual executor), else
  ``cuda:(local_rank % device_count)`` (the local launcher with every GPU visible). NCCL errors
  and timeouts are handled by torch's NCCL watchdog, which aborts the process when an op
  exceeds the collective timeout.

When every rank is on this host, the engine's negotiation rounds (and the small allreduces
inside them) go through Unix sockets instead (:mod:`.local_mesh`); the ops' data does not.

If ``torch.distributed`` is already initialised (a script that called ``init_process_group``
itself, e.g. under torchrun), the default group is reused and left alone at shutdown.

Dtypes Gloo lacks (``int16``, ``uint16``, ``uint32``, ``uint64``; NCCL lacks the 16-bit ones):
allgather, broadcast and alltoall send their raw bytes (as ``uint8`` rows); reductions run on a
wider integer type and cast back (sums and products wrap around exactly as in the original
type; ``uint64`` reduces as ``int64`` with the sign bit flipped for Min/Max, which keeps its
order). Gloo would otherwise raise "Invalid scalar type". Complex tensors reduce with Sum and
Average only (Min/Max/Product are refused before anything is sent, so the group stays usable).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from spark_estimators._base.gpus import own_cuda_indices
from spark_estimators.collective.backends import local_mesh
from spark_estimators.collective.backends.base import Backend, Buffer, ReduceOp, Topology
from spark_estimators.errors import CollectiveError, ConfigurationError, RendezvousTimeoutError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Set by torchrun when its agent hosts the rendezvous store.
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def _alive(store: dist.Store) -> bool:
    """Whether a kept store still reaches its server."""
    try:
        store.add("spark_estimators/alive", 0)
    except Exception:  # any failure means: make a new one
        return False
    return True


# The process's rendezvous stores and how many inits used each: (addr, port, size, rank) ->
# [store, inits] (see TorchDistributedBackend._rendezvous_store).
_STORES: dict[tuple[str, int, int, int], list[Any]] = {}


def _torch_op(op: ReduceOp) -> dist.ReduceOp.RedOpType:
    import torch.distributed as dist

    return {
        ReduceOp.SUM: dist.ReduceOp.SUM,
        ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        ReduceOp.AVERAGE: dist.ReduceOp.AVG,
    }[op]


def _gather_single(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    import torch.distributed as dist

    # torch >= 2.10 renamed all_gather_into_tensor (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, tensor, group=group)


def _reduce_scatter_single(
    out: torch.Tensor,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, tensor, op=op, group=group)


def _as_tensor(buf: Buffer) -> torch.Tensor:
    import torch

    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf)
    return buf


def _like_input(result: torch.Tensor, buf: Buffer) -> Buffer:
    return result.numpy() if isinstance(buf, np.ndarray) else result


#: dtype names torch.distributed's Gloo cannot send ("Invalid scalar type") -> the wider dtype
#: their reductions run in (uint64 has none: it reduces as int64, see _reduce_wide).
_WIDER = {"int16": "int32", "uint16": "int32", "uint32": "int64", "uint64": "int64"}


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) as ``uint8`` rows: shape ``(dim0, bytes per row)``, same memory."""
    import torch

    rows = int(tensor.shape[0]) if tensor.dim() else 1
    per_row = 1
    for d in tensor.shape[1:]:
        per_row *= int(d)
    return tensor.reshape(rows, per_row).view(torch.uint8)


def _from_bytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows of bytes from :func:`_as_bytes` back as ``like``'s dtype and trailing shape."""
    return raw.view(like.dtype).reshape(int(raw.shape[0]), *like.shape[1:])


def _check_reduction(tensor: torch.Tensor, op: ReduceOp) -> None:
    """Refuse what the backend cannot reduce, before any byte is sent (keeps the group usable)."""
    if tensor.is_complex() and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        raise ConfigurationError(
            f"op={op.name.title()} is not defined for complex tensors ({_dtype_name(tensor)}); "
            "use op=Sum or op=Average"
        )


class TorchDistributedBackend(Backend):
    """Shared implementation of the torch.distributed backends."""

    dist_backend: ClassVar[str] = "gloo"

    def __init__(self, topology: Topology, *, timeout: float, start_timeout: float) -> None:
        super().__init__(topology, timeout=timeout, start_timeout=start_timeout)
        self._owns_group = False
        self.device: torch.device | None = None  # set by start()
        #: The torch process group of a process set; None is the default (global) group.
        self.group: dist.ProcessGroup | None = None
        #: Unix sockets to the other ranks when all share this host (negotiation rounds only).
        self._mesh: local_mesh.LocalMesh | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def _device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def start(self) -> None:
        """Join the torch.distributed group (TCP rendezvous at the rank-0 address)."""
        import torch
        import torch.distributed as dist

        self.device = device = self._device()
        # ReduceOp.AVG: NCCL has it natively; Gloo since torch 2.7 (saves a scaling pass).
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        self.native_average = self.name == "nccl" or version >= (2, 7)
        if dist.is_initialized():
            if dist.get_world_size() != self.size or dist.get_rank() != self.rank:
                raise ConfigurationError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the environment says rank {self.rank} of "
                    f"{self.size}; call init() before init_process_group or not at all"
                )
            logger.debug("reusing the existing torch.distributed default group")
            return
        timeout = datetime.timedelta(seconds=self.timeout)
        store = self._rendezvous_store()
        try:
            dist.init_process_group(
                self.dist_backend,
                store=store,
                rank=self.rank,
                world_size=self.size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(
                f"rank {self.rank}: torch.distributed.init_process_group("
                f"{self.dist_backend!r}) failed: {exc}"
            ) from exc
        self._owns_group = True
        if local_mesh.enabled(self.size, self.topology.local_size):
            self._mesh = local_mesh.LocalMesh.connect(
                store, self.rank, self.size, timeout=self.timeout, start_timeout=self.start_timeout
            )

    def _rendezvous_store(self) -> dist.Store:
        """The store of this init: the process's one TCP store, under a prefix per init.

        The store (rank 0 serves it at the advertised port) is made once per process and kept:
        ``shutdown()`` then ``init()`` (horovod's tests do it around every test) meets the other
        ranks on it again under the next prefix. A new server on the same port failed with
        EADDRINUSE whenever the old one was still referenced (a traceback keeping a test's
        optimizer alive was enough). Every rank counts its inits, so the prefixes agree.
        """
        import importlib

        import torch.distributed as dist

        if self.size == 1:
            return dist.HashStore()
        topo = self.topology
        key = (topo.master_addr, topo.master_port, self.size, self.rank)
        cached = _STORES.get(key)
        if cached is not None and not _alive(cached[0]):
            cached = None  # the server went away (a relaunched rank 0 serves a new one)
        if cached is None:
            # A rank of run()/an estimator meets in the driver's authenticated store (only the
            # job's secret opens it), not in an open TCPStore on the rank-0 port: the rank's
            # entry point patched torch's rendezvous module to offer it (driver/store_client.py).
            rendezvous = importlib.import_module("torch.distributed.rendezvous")
            offer = getattr(rendezvous._create_c10d_store, "driver_store_for", None)
            store = None if offer is None else offer(
                topo.master_addr, topo.master_port, self.size, self.start_timeout
            )  # fmt: skip
            if store is not None:
                cached = _STORES[key] = [store, 0]
        if cached is None:
            # Under torchrun the agent already serves the store: every rank is a client.
            agent_store = os.environ.get(TORCHELASTIC_USE_AGENT_STORE, "").lower() == "true"
            try:
                store = dist.TCPStore(
                    topo.master_addr,
                    topo.master_port,
                    self.size,
                    is_master=self.rank == 0 and not agent_store,
                    timeout=datetime.timedelta(seconds=self.start_timeout),
                    wait_for_workers=True,
                )
            except (RuntimeError, OSError) as exc:
                raise RendezvousTimeoutError(
                    f"rank {self.rank} could not meet the other {self.size - 1} rank(s) at "
                    f"{topo.master_addr}:{topo.master_port} within start_timeout="
                    f"{self.start_timeout:g}s ({exc}); check that every rank was started and "
                    "that the address is reachable, or raise SPARK_ESTIMATORS_START_TIMEOUT",
                    expected=self.size,
                ) from exc
            cached = _STORES[key] = [store, 0]
        cached[1] += 1
        if cached[1] == 1:
            return cached[0]  # the first init keeps torch's own key layout
        return dist.PrefixStore(f"spark_estimators/init{cached[1]}", cached[0])

    def subgroup(self, ranks: Sequence[int]) -> Backend | None:
        """A backend over a ``torch.distributed.new_group`` of ``ranks``; None on non-members."""
        import torch.distributed as dist

        members = [int(r) for r in ranks]
        # Every rank of the default group must call new_group, members or not.
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=self.timeout))
        if self.rank not in members:
            return None
        index = members.index(self.rank)
        topo = Topology(
            rank=index,
            size=len(members),
            local_rank=index,
            local_size=len(members),
            master_addr=self.topology.master_addr,
            hostname=self.topology.hostname,
        )
        sub = type(self)(topo, timeout=self.timeout, start_timeout=self.start_timeout)
        sub.group, sub.device, sub.native_average = group, self.device, self.native_average
        return sub

    def shutdown(self) -> None:
        """Destroy the process group (a subgroup destroys only itself)."""
        import torch.distributed as dist

        if self._mesh is not None:
            self._mesh.close()
            self._mesh = None

        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception as exc:  # a broken group must not stop the shutdown
                logger.debug("destroying a process set's group failed: %s", exc)
            self.group = None
            return
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group must not stop the shutdown
                logger.debug("destroy_process_group failed: %s", exc)
        self._owns_group = False

    # -- data ops ----------------------------------------------------------------------------
    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """Reduce ``buf`` in place with ``torch.distributed.all_reduce``."""
        import torch.distributed as dist

        tensor = _as_tensor(buf)
        _check_reduction(tensor, op)
        if _dtype_name(tensor) in _WIDER:
            self._reduce_wide(tensor, op)
            return
        dist.all_reduce(tensor, op=_torch_op(op), group=self.group)

    def _reduce_wide(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Allreduce a dtype Gloo lacks in a wider integer type, then cast back in place."""
        import torch
        import torch.distributed as dist

        if _dtype_name(tensor) == "uint64":
            # Same bits as int64: sums and products wrap identically; flipping the sign bit
            # maps unsigned order onto signed order for Min/Max.
            wide = tensor.view(torch.int64).clone()
            flip = op in (ReduceOp.MIN, ReduceOp.MAX)
            if flip:
                wide ^= torch.iinfo(torch.int64).min
            dist.all_reduce(wide, op=_torch_op(op), group=self.group)
            if flip:
                wide ^= torch.iinfo(torch.int64).min
            tensor.view(torch.int64).copy_(wide)
            return
        wide = tensor.to(getattr(torch, _WIDER[_dtype_name(tensor)]))
        dist.all_reduce(wide, op=_torch_op(op), group=self.group)
        tensor.copy_(wide)  # integer casts keep the low bits: the wrap-around of the narrow type

    def broadcast(self, buf: Buffer, root: int) -> None:
        """Overwrite ``buf`` with rank ``root``'s (``torch.distributed.broadcast``)."""
        import torch.distributed as dist

        tensor = _as_tensor(buf)
        if _dtype_name(tensor) in _WIDER:
            tensor = _as_bytes(tensor)  # same memory: the broadcast writes into buf
        if self.group is None:
            dist.broadcast(tensor, src=root)
        else:
            dist.broadcast(tensor, group=self.group, group_src=root)

    def barrier(self) -> None:
        """Block until every rank of the group arrives."""
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def allgather(self, buf: Buffer, first_dims: Sequence[int]) -> Buffer:
        """Concatenate every rank's ``buf`` on the first dimension (sizes may differ)."""
        import torch

        tensor = _as_tensor(buf)
        if _dtype_name(tensor) in _WIDER:
            raw = _as_tensor(self.allgather(_as_bytes(tensor.contiguous()), first_dims))
            return _like_input(_from_bytes(raw, tensor), buf)
        rest = tuple(tensor.shape[1:])
        most = max(first_dims)
        if all(d == most for d in first_dims):
            out = tensor.new_empty((most * self.size, *rest))
            if out.numel():
                _gather_single(out, tensor.contiguous(), self.group)
            return _like_input(out, buf)
        # Gloo needs equal sizes: pad every contribution to the largest, then drop the padding.
        padded = tensor.new_zeros((most, *rest))
        padded[: tensor.shape[0]] = tensor
        gathered = tensor.new_empty((most * self.size, *rest))
        _gather_single(gathered, padded, self.group)
        parts = [gathered[r * most : r * most + d] for r, d in enumerate(first_dims)]
        return _like_input(torch.cat(parts), buf)

    def gather_vectors(self, vector: np.ndarray) -> np.ndarray:
        """The negotiation round: over the local mesh when there is one, else the allgather."""
        if self._mesh is not None:
            return self._mesh.allgather(vector)
        return super().gather_vectors(vector)

    def local_mesh(self) -> local_mesh.LocalMesh | None:
        """The Unix sockets of the negotiation rounds, when all ranks share this host."""
        return self._mesh

    def alltoall(self, buf: Buffer, send_rows: Sequence[int], recv_rows: Sequence[int]) -> Buffer:
        """Exchange row blocks with every rank (``all_to_all_single``)."""
        import torch.distributed as dist

        tensor = _as_tensor(buf)
        if _dtype_name(tensor) in _WIDER:
            raw = self.alltoall(_as_bytes(tensor.contiguous()), send_rows, recv_rows)
            return _like_input(_from_bytes(_as_tensor(raw), tensor), buf)
        out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
        dist.all_to_all_single(
            out,
            tensor.contiguous(),
            output_split_sizes=list(recv_rows),
            input_split_sizes=list(send_rows),
            group=self.group,
        )
        return _like_input(out, buf)

    def reducescatter(self, buf: Buffer, op: ReduceOp, rows: Sequence[int]) -> Buffer:
        """Reduce ``buf`` and return this rank's block of ``rows`` rows."""
        tensor = _as_tensor(buf)
        _check_reduction(tensor, op)
        if len(set(rows)) > 1 or op is not ReduceOp.SUM or _dtype_name(tensor) in _WIDER:
            return super().reducescatter(buf, op, rows)  # an allreduce, widened if needed
        out = tensor.new_empty((rows[self.rank], *tensor.shape[1:]))
        _reduce_scatter_single(out, tensor.contiguous(), _torch_op(op), self.group)
        return _like_input(out, buf)

    def zeros(self, numel: int, dtype: str, device: str) -> Buffer:
        """A zero tensor on ``device`` (``cuda`` under nccl)."""
        import torch

        target = self.device if device == "cuda" else torch.device("cpu")
        return torch.zeros(numel, dtype=getattr(torch, dtype), device=target)


class GlooBackend(TorchDistributedBackend):
    """CPU collectives over Gloo (the default without a GPU)."""

    name = "gloo"
    dist_backend = "gloo"


class NcclBackend(TorchDistributedBackend):
    """GPU collectives over NCCL, with Gloo for CPU buffers in the same group."""

    name = "nccl"
    dist_backend = "cpu:gloo,cuda:nccl"

    def _device(self) -> torch.device:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise ConfigurationError(
                "backend='nccl' needs a CUDA device, but torch sees none; use backend='gloo' "
                "or 'auto'"
            )
        own = [i for i in own_cuda_indices() if i < torch.cuda.device_count()]
        index = own[0] if own else self.topology.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
