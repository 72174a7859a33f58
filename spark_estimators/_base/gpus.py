"""Which GPUs a rank sees and which of them are its own (no CUDA, no torch: only variables).

The design (docs/clusters.md, "GPUs"): the ranks of one host see **the job's GPUs on that host**,
``CUDA_VISIBLE_DEVICES`` in local-rank order, and the local ranks of a host are ordered by their
tasks' GPU addresses. With one GPU per task, CUDA device ``local_rank`` is the rank's own GPU
(horovod's ``torch.cuda.set_device(hvd.local_rank())``); on the usual executor (it owns its
node's GPUs ``0..k-1``, one per task) the list is ``0..k-1`` in order, so
``gpus[int(get_available_devices()[0])]`` is it as well. ``SPARK_ESTIMATORS_GPU_ADDRESSES``
holds the task's own addresses (Spark's), from which :func:`own_cuda_indices` finds the CUDA
indices in every case (addresses ``"2","3"``, two GPUs per task, an unmasked executor).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from spark_estimators import envvars as ev


def split_ids(value: str | None) -> list[str]:
    """``"2, 3,"`` -> ``["2", "3"]``."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def address_key(address: str) -> tuple[int, int, str]:
    """Sort key of a GPU address: numbers by value ("2" < "10"), then other names (UUIDs)."""
    return (0, int(address), "") if address.isdigit() else (1, 0, address)


def gpus_key(addresses: Iterable[str]) -> tuple[tuple[int, int, str], ...]:
    """Sort key of a task by its GPU addresses (the lowest first)."""
    return tuple(sorted(address_key(a) for a in addresses))


def host_gpus(per_task: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """The GPUs of a host's tasks (given in local-rank order), each once, in that order."""
    seen: list[str] = []
    for addresses in per_task:
        seen.extend(a for a in addresses if a not in seen)
    return tuple(seen)


def own_cuda_indices(env: Mapping[str, str] | None = None) -> list[int]:
    """CUDA device indices, in this process's view, of the rank's own GPUs; ``[]``: none.

    * With Spark addresses (``SPARK_ESTIMATORS_GPU_ADDRESSES``): each address's position in
      ``CUDA_VISIBLE_DEVICES``; an address not listed there is taken as an index into it (an
      executor whose discovery script numbers the GPUs it sees); with ``CUDA_VISIBLE_DEVICES``
      unset, the address itself (``"3"`` -> 3).
    * Without addresses (the local launcher, a plain process): the visible GPU
      ``local_rank % count`` first, then the others in turn, so ranks spread over the GPUs;
      ``[]`` when ``CUDA_VISIBLE_DEVICES`` is unset or empty (nothing says the rank has a GPU).
    """
    env = os.environ if env is None else env
    visible = split_ids(env[ev.CUDA_VISIBLE_DEVICES]) if ev.CUDA_VISIBLE_DEVICES in env else None
    own = split_ids(env.get(ev.SE_GPU_ADDRESSES))
    if own:
        out = []
        for address in own:
            if visible is not None and address in visible:
                out.append(visible.index(address))
            elif address.isdigit() and (visible is None or int(address) < len(visible)):
                out.append(int(address))
        return out
    if not visible:
        return []
    local_rank = int(env.get(ev.SE_LOCAL_RANK) or env.get(ev.LOCAL_RANK) or 0)
    n = len(visible)
    return [(local_rank + i) % n for i in range(n)]
