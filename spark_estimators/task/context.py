"""Per-process context of a rank: the connection to the driver for events, and device helpers."""

from __future__ import annotations

import os
import threading
from typing import Any

from spark_estimators import envvars as ev

_client: Any = None
_rank: int = -1
_lock = threading.Lock()


def set_driver_client(client: Any, rank: int) -> None:
    """Called once by the rank process entry point."""
    global _client, _rank
    with _lock:
        _client, _rank = client, rank


def has_driver() -> bool:
    """True inside a rank started by :func:`spark_estimators.run`."""
    return _client is not None


def send_event(kind: str, data: Any) -> bool:
    """Send a small picklable event (metrics, progress) to the driver; False outside ``run``."""
    with _lock:
        client, rank = _client, _rank
    if client is None:
        return False
    client.call("event", {"rank": rank, "kind": kind, "data": data})
    return True


def get_available_devices() -> list[str]:
    """Devices this rank should use: ``["cuda:0", ...]`` for the task's GPUs, else ``["cpu"]``.

    The launcher masks ``CUDA_VISIBLE_DEVICES`` to the GPUs Spark assigned to the task, so the
    first assigned GPU is always ``cuda:0`` inside the rank (do not use ``LOCAL_RANK`` for it).
    """
    visible = os.environ.get(ev.CUDA_VISIBLE_DEVICES, "")
    ids = [v for v in visible.split(",") if v.strip() != ""]
    if not ids:
        return ["cpu"]
    return [f"cuda:{i}" for i in range(len(ids))]
