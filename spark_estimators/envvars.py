"""Names of every environment variable spark_estimators reads or sets, in one place.

Inside a rank process the launcher sets torchrun's variables (so existing ``torch.distributed``
code runs unchanged) and ours (read by :func:`spark_estimators.collective.init`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N")

# torchrun-compatible variables set in every rank process.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# horovodrun's (Gloo) rank variables, set as well so horovod-era code that reads them (horovod's
# own test suite does) runs unchanged; spark_estimators itself reads ours.
HOROVOD_RANK_VARS = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
)

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
# Spark's GPU addresses assigned to the rank's task (comma-separated; empty without GPUs).
SE_GPU_ADDRESSES = PREFIX + "GPU_ADDRESSES"
SE_BACKEND = PREFIX + "BACKEND"
#: The collective backend names (``run(backend=)``, ``init(backend=)``, ``launch --backend``,
#: the estimators' ``collective_backend`` and :data:`SE_BACKEND`): "auto" picks nccl when the
#: rank has a CUDA device, else gloo.
BACKEND_NAMES = ("auto", "gloo", "nccl", "mpi")
SE_HOSTNAME = PREFIX + "HOSTNAME"
SE_JOB_ID = PREFIX + "JOB_ID"
#: The rank's scratch dir, removed by its Spark task when the rank exits (task/scratch.py).
RANK_SCRATCH = PREFIX + "RANK_SCRATCH"

# User-facing knobs.
START_TIMEOUT = PREFIX + "START_TIMEOUT"
# Address the executors use to reach the driver service (needed when this process is a Spark
# Connect client on another machine than the executors can reach by default).
DRIVER_HOST = PREFIX + "DRIVER_HOST"
COLLECTIVE_TIMEOUT = PREFIX + "COLLECTIVE_TIMEOUT"
#: Seconds without a heartbeat after which a run's lock counts as stale (store/lock.py).
RUN_LOCK_TIMEOUT = PREFIX + "RUN_LOCK_TIMEOUT"
HOST_HASH_SALT = PREFIX + "HOST_HASH_SALT"
FUSION_THRESHOLD = PREFIX + "FUSION_THRESHOLD"
#: Horovod's cycle time: queued async allreduces are fused and run once no new op has come for
#: this many milliseconds (or at once when a thread waits for one); see runtime/engine.py.
CYCLE_TIME = PREFIX + "CYCLE_TIME"
INLINE_LIMIT = PREFIX + "INLINE_LIMIT"
#: "0" sends the negotiation rounds of same-host ranks through the backend, not Unix sockets
#: (collective/backends/local_mesh.py).
LOCAL_MESH = PREFIX + "LOCAL_MESH"
#: Microseconds a rank waiting for a local mesh round polls its sockets without sleeping before
#: it sleeps in poll() (collective/backends/local_mesh.py). Default: 300 when this host's ranks do
#: not outnumber the cores this process may use, else 0; "0" always sleeps.
MESH_SPIN_US = PREFIX + "MESH_SPIN_US"
#: "0" keeps DistributedOptimizer's last bucket on the engine's negotiated path every step
#: (collective/torch/steady.py) and turns off the engine's response cache (runtime/cache.py).
STEADY_ALLREDUCE = PREFIX + "STEADY_ALLREDUCE"
MAX_FRAME_BYTES = PREFIX + "MAX_FRAME_BYTES"
#: Secret that signs saved models and estimators (HMAC-SHA256 of ``stage.pkl``) and is required
#: to load them; see core/persistence.py and docs/security.md.
MODEL_KEY = PREFIX + "MODEL_KEY"
LAZY_DYNAMO = PREFIX + "LAZY_DYNAMO"  # "0" turns off the rank's deferred torch._dynamo import
#: Path of the collective timeline (per-rank Chrome trace); see collective/api/timeline.py.
#: ``DYNAMIC`` (as Horovod's) starts none at init: start_timeline(path) starts it later.
TIMELINE = PREFIX + "TIMELINE"
TIMELINE_DYNAMIC = "DYNAMIC"

# Horovod's variables that have an equivalent here (ours win when both are set); the table in
# docs/collective.md lists them with the ignored ones (IGNORED_HOROVOD below).
HOROVOD_TIMELINE = "HOROVOD_TIMELINE"
HOROVOD_FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
HOROVOD_CYCLE_TIME = "HOROVOD_CYCLE_TIME"
HOROVOD_GLOO_TIMEOUT_SECONDS = "HOROVOD_GLOO_TIMEOUT_SECONDS"
HOROVOD_START_TIMEOUT = "HOROVOD_START_TIMEOUT"
HOROVOD_SPARK_START_TIMEOUT = "HOROVOD_SPARK_START_TIMEOUT"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
HOROVOD_DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"
#: Hierarchical collectives (collective/backends/hierarchical.py): "1" turns them on.
HOROVOD_HIERARCHICAL_ALLREDUCE = "HOROVOD_HIERARCHICAL_ALLREDUCE"
HOROVOD_HIERARCHICAL_ALLGATHER = "HOROVOD_HIERARCHICAL_ALLGATHER"
#: Autotune (collective/runtime/autotune.py) and its parameters, with Horovod's defaults.
HOROVOD_AUTOTUNE = "HOROVOD_AUTOTUNE"
HOROVOD_AUTOTUNE_LOG = "HOROVOD_AUTOTUNE_LOG"
HOROVOD_AUTOTUNE_WARMUP_SAMPLES = "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"
HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE = "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"
HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES = "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE = "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"
#: The engine's response cache (collective/runtime/cache.py): most batches it keeps; 0 turns it off.
HOROVOD_CACHE_CAPACITY = "HOROVOD_CACHE_CAPACITY"
#: Horovod variables read nowhere here, with what to do instead (a warning names them).
IGNORED_HOROVOD: dict[str, str] = {
    "HOROVOD_TIMELINE_MARK_CYCLES": "cycles are not marked in the timeline (each op's "
    "QUEUE and NEGOTIATE events show its wait)",
    "HOROVOD_CPU_OPERATIONS": "choose the backend with backend='gloo'|'mpi' in run()/launch",
    "HOROVOD_CONTROLLER": "choose the backend with backend='gloo'|'mpi' in run()/launch",
    "HOROVOD_LOG_LEVEL": "configure logging.getLogger('spark_estimators') instead",
    "HOROVOD_STALL_CHECK_DISABLE": "mismatched ops fail at once; hung peers hit the timeout",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "mismatched ops fail at once; see "
    + PREFIX
    + "COLLECTIVE_TIMEOUT",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "see " + PREFIX + "COLLECTIVE_TIMEOUT",
    "HOROVOD_MPI_THREADS_DISABLE": "the mpi backend needs MPI_THREAD_SERIALIZED or higher",
    "HOROVOD_NUM_NCCL_STREAMS": "NCCL streams are torch.distributed's",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "fusion copies are torch's",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped ops are always fused per dtype and device",
    "HOROVOD_THREAD_AFFINITY": "the engine thread is not pinned",
    "HOROVOD_GLOO_IFACE": "the rendezvous address comes from the launcher",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "Adasum here is one allgather, not chunked",
    "HOROVOD_ENABLE_XLA_OPS": "TensorFlow XLA ops are not provided",
}
# Driver service (RPC) limits, read by the driver when it starts a job's service.
RPC_AUTH_TIMEOUT = PREFIX + "RPC_AUTH_TIMEOUT"
RPC_FRAME_TIMEOUT = PREFIX + "RPC_FRAME_TIMEOUT"
RPC_MAX_UNAUTHENTICATED = PREFIX + "RPC_MAX_UNAUTHENTICATED"
RPC_MAX_UNAUTHENTICATED_PER_HOST = PREFIX + "RPC_MAX_UNAUTHENTICATED_PER_HOST"
RPC_LOG_INTERVAL = PREFIX + "RPC_LOG_INTERVAL"

DEFAULT_START_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = 120.0
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
#: Horovod's default cycle time (milliseconds) since 0.21.
DEFAULT_CYCLE_TIME_MS = 1.0
#: Bytes a whole negotiation round may gather for inline allreduces (all ranks together).
DEFAULT_INLINE_GATHER_BYTES = 1024 * 1024
#: The most bytes one rank sends inline, whatever the job size.
DEFAULT_INLINE_LIMIT_MAX = 256 * 1024


def _env_number(name: str, default: _N, parse: Callable[[str], _N], what: str) -> _N:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not {what}") from exc


def env_float(name: str, default: float) -> float:
    """Read a float from the environment, with a clear error when it is not a number."""
    return float(_env_number(name, default, float, "a number"))


def env_int(name: str, default: int) -> int:
    """Read an int from the environment, with a clear error when it is not an integer."""
    return int(_env_number(name, default, int, "an integer"))


def env_on(name: str) -> bool:
    """A switch that is on unless set to ``0``, ``false``, ``no`` or ``off`` (any case)."""
    return os.environ.get(name, "").strip().lower() not in ("0", "false", "no", "off")


def first_set(*names: str) -> str | None:
    """The first of ``names`` set to a non-empty value in the environment, or None."""
    for name in names:
        if os.environ.get(name, "").strip():
            return name
    return None


def start_timeout() -> float:
    """Seconds to wait for every rank to register.

    Env ``SPARK_ESTIMATORS_START_TIMEOUT``, else Horovod's ``HOROVOD_SPARK_START_TIMEOUT`` or
    ``HOROVOD_START_TIMEOUT``, else 60.
    """
    name = first_set(START_TIMEOUT, HOROVOD_SPARK_START_TIMEOUT, HOROVOD_START_TIMEOUT)
    return DEFAULT_START_TIMEOUT if name is None else env_float(name, DEFAULT_START_TIMEOUT)


def collective_timeout() -> float:
    """Seconds before a collective op gives up.

    Env ``SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT``, else Horovod's ``HOROVOD_GLOO_TIMEOUT_SECONDS``,
    else 120.
    """
    name = first_set(COLLECTIVE_TIMEOUT, HOROVOD_GLOO_TIMEOUT_SECONDS)
    default = DEFAULT_COLLECTIVE_TIMEOUT
    return default if name is None else env_float(name, default)
