"""Names of every environment variable spark_estimators reads or sets, in one place.

Inside a rank process the launcher sets torchrun's variables (so existing ``torch.distributed``
code runs unchanged) and ours (read by :func:`spark_estimators.collective.init`).
"""

from __future__ import annotations

import os

# torchrun-compatible variables set in every rank process.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# Our own rank settings.
PREFIX = "SPARK_ESTIMATORS_"
SE_RANK = PREFIX + "RANK"
SE_SIZE = PREFIX + "SIZE"
SE_LOCAL_RANK = PREFIX + "LOCAL_RANK"
SE_LOCAL_SIZE = PREFIX + "LOCAL_SIZE"
SE_CROSS_RANK = PREFIX + "CROSS_RANK"
SE_CROSS_SIZE = PREFIX + "CROSS_SIZE"
SE_MASTER_ADDR = PREFIX + "MASTER_ADDR"
SE_MASTER_PORT = PREFIX + "MASTER_PORT"
SE_BACKEND = PREFIX + "BACKEND"
SE_HOSTNAME = PREFIX + "HOSTNAME"
SE_JOB_ID = PREFIX + "JOB_ID"

# User-facing knobs.
START_TIMEOUT = PREFIX + "START_TIMEOUT"
COLLECTIVE_TIMEOUT = PREFIX + "COLLECTIVE_TIMEOUT"
HOST_HASH_SALT = PREFIX + "HOST_HASH_SALT"
FUSION_THRESHOLD = PREFIX + "FUSION_THRESHOLD"
INLINE_LIMIT = PREFIX + "INLINE_LIMIT"
MAX_FRAME_BYTES = PREFIX + "MAX_FRAME_BYTES"

DEFAULT_START_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = 120.0
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
#: Bytes a whole negotiation round may gather for inline allreduces (all ranks together).
DEFAULT_INLINE_GATHER_BYTES = 1024 * 1024
#: The most bytes one rank sends inline, whatever the job size.
DEFAULT_INLINE_LIMIT_MAX = 256 * 1024


def env_float(name: str, default: float) -> float:
    """Read a float from the environment, with a clear error when it is not a number."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


def env_int(name: str, default: int) -> int:
    """Read an int from the environment, with a clear error when it is not an integer."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def start_timeout() -> float:
    """Seconds to wait for every rank to register (env ``SPARK_ESTIMATORS_START_TIMEOUT``)."""
    return env_float(START_TIMEOUT, DEFAULT_START_TIMEOUT)


def collective_timeout() -> float:
    """Seconds before a collective op gives up (env ``SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT``)."""
    return env_float(COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT)
