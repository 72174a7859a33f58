"""Per-process context of a rank: the connection to the driver for events, and device helpers."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from spark_estimators import envvars as ev
from spark_estimators._base.gpus import own_cuda_indices, split_ids

if TYPE_CHECKING:
    from spark_estimators.driver.rpc import RpcClient

_client: RpcClient | None = None
_rank: int = -1
_lock = threading.Lock()
_task_started: float | None = None
_marks: list[tuple[str, float]] = []


def set_driver_client(client: RpcClient, rank: int) -> None:
    """Called once by the rank process entry point."""
    global _client, _rank
    with _lock:
        _client, _rank = client, rank
    from spark_estimators.driver.store_client import install_env_rendezvous

    # torch's env:// rendezvous (Lightning, a plain init_process_group) meets in the driver's
    # authenticated store instead of an open TCPStore on MASTER_PORT.
    install_env_rendezvous(driver_client)


def driver_client() -> RpcClient | None:
    """The rank's connection to the driver service (None outside a rank)."""
    return _client


def set_task_started(timestamp: float | None) -> None:
    """Called by the rank process entry point with its Spark task's start time."""
    global _task_started
    _task_started = None if timestamp is None else float(timestamp)


def task_started() -> float | None:
    """``time.time()`` when this rank's Spark task started (None outside a rank).

    Start-up benchmarks measure from it (``bench/startup.py``).
    """
    return _task_started


def mark(name: str, when: float | None = None) -> None:
    """Note that the rank's start-up reached ``name`` now (or at ``when``): see :func:`marks`."""
    _marks.append((name, time.time() if when is None else float(when)))


def marks() -> list[tuple[str, float]]:
    """The start-up steps this rank process noted, ``(name, time.time())`` in order.

    The task, the zygote and the rank's framework code mark where the start-up goes (registered,
    zygote imported, function fetched, process group joined, ...): ``bench/startup.py`` shows it.
    """
    return list(_marks)


def has_driver() -> bool:
    """True inside a rank started by :func:`spark_estimators.run`."""
    return _client is not None


def send_event(kind: str, data: object) -> bool:
    """Send a small picklable event (metrics, progress) to the driver; False outside ``run``."""
    with _lock:
        client, rank = _client, _rank
    if client is None:
        return False
    client.call("event", {"rank": rank, "kind": kind, "data": data})
    return True


def get_available_devices() -> list[str]:
    """Spark's GPU addresses assigned to this rank's task, like Horovod's function of that name.

    Returns the addresses as Spark's resource scheduler gave them (``["3"]`` for a task that got
    GPU 3 of its executor), or ``[]`` when the task has no GPU. Called inside a plain Spark task
    (not a rank), it asks :class:`pyspark.TaskContext`.

    A rank sees the job's GPUs on its host, in local-rank order (docs/clusters.md, "GPUs"): on
    the usual executor (GPUs ``0..k-1``, one per task) horovod's
    ``gpus[int(get_available_devices()[0])]`` is the rank's own GPU; :func:`get_device` is it
    in every case.

    >>> from spark_estimators.task import get_available_devices
    >>> get_available_devices()  # doctest: +SKIP
    ['3']
    """
    addresses = os.environ.get(ev.SE_GPU_ADDRESSES)
    if addresses is not None:
        return split_ids(addresses)
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return []
    gpu = ctx.resources().get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def get_devices() -> list[str]:
    """Torch device names of this rank's own GPUs (``["cuda:1"]``), else ``["cpu"]``.

    Each of the task's Spark GPUs as CUDA numbers it in the rank (its position in
    ``CUDA_VISIBLE_DEVICES``). Without Spark addresses (the local launcher) every visible GPU,
    the one of ``local_rank % count`` first.
    """
    indices = own_cuda_indices()
    return [f"cuda:{i}" for i in indices] if indices else ["cpu"]


def get_device() -> str:
    """The device this rank should train on: its own GPU (``"cuda:1"``), else ``"cpu"``.

    Right on every executor layout (one or several GPUs per task, any addresses); on the usual
    one it equals horovod's ``torch.cuda.set_device(hvd.local_rank())``.

    >>> import torch
    >>> from spark_estimators.task import get_device
    >>> device = torch.device(get_device())  # doctest: +SKIP
    """
    return get_devices()[0]
