"""Where ``collective.init()`` finds its rank, its backend and its knobs: the environment.

Our variables (set by :func:`spark_estimators.run` and ``python -m spark_estimators.launch``) are
read first; torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are the fallback, so the
same script also runs under ``torchrun``. Then an MPI launcher's (``mpiexec`` of MPICH sets
``PMI_RANK``/``PMI_SIZE``, Open MPI's ``OMPI_COMM_WORLD_RANK``/``..._SIZE``): under ``mpiexec
-n N python script.py`` the ``"auto"`` backend is ``mpi``, which needs no rendezvous address.
With none of them, the process is a job of one (Horovod does the same when a script is started
without its launcher).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import Topology
from spark_estimators.errors import ConfigurationError

logger = logging.getLogger(__name__)

#: torchrun sets this next to GROUP_RANK (number of nodes); used when ours is absent.
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
#: Rank / size / local rank / local size variables of MPI launchers (MPICH hydra, Open MPI).
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
MPI_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
MPI_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ConfigurationError(
                    f"environment variable {name}={raw!r} is not an integer"
                ) from None
    return default


def _first_str(names: tuple[str, ...]) -> str | None:
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw:
            return raw
    return None


def launched_by_mpi() -> bool:
    """True in a process started by ``mpiexec`` / ``mpirun`` rather than by our launchers."""
    return os.environ.get(ev.SE_SIZE) is None and _first_str(MPI_SIZE_VARS) is not None


def topology_from_env(rendezvous: bool = True) -> Topology:
    """The :class:`~spark_estimators.collective.backends.base.Topology` of this process.

    Parameters
    ----------
    rendezvous
        Whether the backend needs a rendezvous address for ``size > 1`` (MPI does not).

    Raises
    ------
    ConfigurationError
        A variable is not an integer, a rank is out of range, or ``size > 1`` without a
        rendezvous address.
    """
    size = _first_int((ev.SE_SIZE, ev.WORLD_SIZE, *MPI_SIZE_VARS), 1)
    rank = _first_int((ev.SE_RANK, ev.RANK, *MPI_RANK_VARS), 0)
    # Without local information assume one host, as a plain multi-process launch would be.
    local_size = _first_int((ev.SE_LOCAL_SIZE, ev.LOCAL_WORLD_SIZE, *MPI_LOCAL_SIZE_VARS), size)
    local_rank = _first_int(
        (ev.SE_LOCAL_RANK, ev.LOCAL_RANK, *MPI_LOCAL_RANK_VARS), rank % max(local_size, 1)
    )
    cross_rank = _first_int((ev.SE_CROSS_RANK, ev.GROUP_RANK), 0)
    cross_size = _first_int((ev.SE_CROSS_SIZE, GROUP_WORLD_SIZE), max(1, size // local_size))
    addr = _first_str((ev.SE_MASTER_ADDR, ev.MASTER_ADDR))
    port = _first_int((ev.SE_MASTER_PORT, ev.MASTER_PORT), 0)
    if size > 1 and rendezvous and (addr is None or port <= 0):
        raise ConfigurationError(
            f"size={size} ranks need a rendezvous point: set {ev.SE_MASTER_ADDR} and "
            f"{ev.SE_MASTER_PORT} (or MASTER_ADDR/MASTER_PORT), or start the script with "
            "python -m spark_estimators.launch -np N, torchrun or spark_estimators.run"
        )
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        master_addr=addr or "127.0.0.1",
        master_port=port,
        hostname=os.environ.get(ev.SE_HOSTNAME)
        or os.environ.get(ev.HOROVOD_HOSTNAME)
        or socket.gethostname(),
    )


def requested_backend(backend: str | None = None) -> str:
    """The backend name asked for: the argument, else ``SPARK_ESTIMATORS_BACKEND``, else auto."""
    name = (backend or os.environ.get(ev.SE_BACKEND, "") or "auto").strip().lower()
    if name not in ev.BACKEND_NAMES:
        from spark_estimators.collective.backends.base import registered_backends

        if name not in registered_backends():
            raise ConfigurationError(
                f"backend={name!r} is not one of {', '.join(ev.BACKEND_NAMES)} "
                f"(argument of init() or {ev.SE_BACKEND})"
            )
    return name


def resolve_backend(name: str) -> str:
    """Turn ``"auto"`` into a concrete name.

    Under ``mpiexec`` (with mpi4py installed): mpi. Otherwise nccl with a CUDA device, else
    gloo, else mpi.
    """
    if name != "auto":
        return name
    if launched_by_mpi() and importlib.util.find_spec("mpi4py") is not None:
        return "mpi"
    if importlib.util.find_spec("torch") is not None:
        import torch

        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    if importlib.util.find_spec("mpi4py") is not None:
        return "mpi"
    raise ConfigurationError(
        "backend='auto' found neither torch (gloo/nccl) nor mpi4py (mpi); install one with "
        "pip install 'spark-estimators[torch]' or 'spark-estimators[mpi]'"
    )


def backend_for_host(name: str, requested: str, topology: Topology, gpus: int) -> str:
    """``name`` once the host's ranks are known: NCCL needs a GPU of its own per rank.

    With more ranks on this host than the ``gpus`` it sees (``LocalBackend(2)`` or ``local[2]``
    on a one-GPU machine, or Spark tasks without GPU scheduling), NCCL refuses the group
    ("invalid usage"). A one-host job that asked for ``auto`` takes Gloo, which carries CUDA
    tensors and lets ranks share a GPU; otherwise (``nccl`` asked for, or several hosts, which
    must all agree on the backend) the rank stops here with what to change.
    """
    if name != "nccl" or gpus == 0 or topology.local_size <= gpus:
        return name  # no GPU at all: the NCCL backend itself says so
    if requested == "auto" and topology.size == topology.local_size:
        logger.info(
            "collective backend auto: %d ranks share %d GPU(s) on this host, and NCCL needs "
            "one per rank: using gloo",
            topology.local_size,
            gpus,
        )
        return "gloo"
    raise ConfigurationError(
        f"backend {requested!r} resolves to nccl, but {topology.local_size} ranks on host "
        f"{topology.hostname or 'this host'} share {gpus} GPU(s), and NCCL needs one GPU per "
        "rank: give each rank its own GPU (Spark: spark.task.resource.gpu.amount=1; "
        "LocalBackend: num_proc <= GPUs), or use backend 'gloo'"
    )


def _positive_seconds(value: float, what: str, env_name: str) -> float:
    if value <= 0:
        raise ConfigurationError(f"{what} must be > 0 seconds, got {value!r} ({env_name})")
    return value


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds an op may wait for its peers (argument, else env, default 120)."""
    value = ev.collective_timeout() if timeout is None else float(timeout)
    return _positive_seconds(value, "collective timeout", ev.COLLECTIVE_TIMEOUT)


def start_timeout(timeout: float | None = None) -> float:
    """Seconds ``init()`` waits for every rank at the rendezvous (argument, else env, 60)."""
    value = ev.start_timeout() if timeout is None else float(timeout)
    return _positive_seconds(value, "start timeout", ev.START_TIMEOUT)


def _byte_count(value: int | None, env_name: str, default: int, what: str, zero: str) -> int:
    """``value``, else the integer in ``env_name``, else ``default``; refuses negatives."""
    if value is None and env_name == ev.FUSION_THRESHOLD:
        env_name = ev.first_set(ev.FUSION_THRESHOLD, ev.HOROVOD_FUSION_THRESHOLD) or env_name
    if value is None:
        try:
            value = ev.env_int(env_name, default)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    if value < 0:
        raise ConfigurationError(f"{what} must be >= 0 bytes ({zero}), got {value!r} ({env_name})")
    return int(value)


def fusion_threshold(threshold: int | None = None) -> int:
    """Bytes per fused gradient bucket (argument, else env, default 128 MiB; 0 = no fusion).

    The env is ``SPARK_ESTIMATORS_FUSION_THRESHOLD``, else Horovod's ``HOROVOD_FUSION_THRESHOLD``.
    """
    return _byte_count(
        threshold,
        ev.FUSION_THRESHOLD,
        ev.DEFAULT_FUSION_THRESHOLD,
        "fusion threshold",
        "0 disables fusion",
    )


def cycle_time(milliseconds: float | None = None) -> float:
    """Milliseconds without a new op after which queued async allreduces are fused and run.

    The argument, else ``SPARK_ESTIMATORS_CYCLE_TIME``, else Horovod's ``HOROVOD_CYCLE_TIME``,
    else 1 (Horovod's default). 0 fuses only what is already queued when the engine looks. The
    wait ends early as soon as a thread waits for a result or polls one (see the engine).
    """
    name = ev.first_set(ev.CYCLE_TIME, ev.HOROVOD_CYCLE_TIME) or ev.CYCLE_TIME
    if milliseconds is None:
        try:
            milliseconds = ev.env_float(name, ev.DEFAULT_CYCLE_TIME_MS)
        except ValueError as exc:
            raise ConfigurationError(f"{exc} (milliseconds, e.g. 1 or 3.5)") from None
    value = float(milliseconds)
    if not value >= 0 or value == float("inf"):
        raise ConfigurationError(
            f"cycle time must be a finite number of milliseconds >= 0 (0: no wait), got "
            f"{milliseconds!r} ({name})"
        )
    return value


def inline_limit(size: int, limit: int | None = None) -> int:
    """Largest CPU allreduce (bytes per rank) sent inside the negotiation message.

    The argument, else ``SPARK_ESTIMATORS_INLINE_LIMIT``, else ``1 MiB / size`` capped at
    256 KiB (a negotiation round gathers ``size`` times this many bytes on every rank). Values
    below the engine's fixed inline room (512 bytes) mean that room only.
    """
    default = min(ev.DEFAULT_INLINE_LIMIT_MAX, ev.DEFAULT_INLINE_GATHER_BYTES // max(size, 1))
    return _byte_count(
        limit, ev.INLINE_LIMIT, default, "inline limit", "0 keeps only the fixed 512-byte room"
    )


def timeline_path(path: str | None = None) -> str | None:
    """The path of the timeline ``init()`` starts, or None.

    The argument, else ``SPARK_ESTIMATORS_TIMELINE``, else ``HOROVOD_TIMELINE``. ``DYNAMIC``
    (any case), as in Horovod, means no timeline at init: the program starts one later with
    ``start_timeline(path)``.
    """
    if not path:
        name = ev.first_set(ev.TIMELINE, ev.HOROVOD_TIMELINE)
        path = None if name is None else os.environ[name].strip()
    if path is None or path.upper() == ev.TIMELINE_DYNAMIC:
        return None
    return path


def ignored_horovod_variables() -> dict[str, str]:
    """Horovod variables set in this process that have no effect here, with the reason."""
    return {k: why for k, why in ev.IGNORED_HOROVOD.items() if os.environ.get(k, "").strip()}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def switch(name: str) -> bool | None:
    """A Horovod on/off variable: True, False, or None when it is not set.

    Horovod sets ``1``; ``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` are accepted
    too (any case); anything else is refused naming the variable.
    """
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(f"environment variable {name}={raw!r} must be 1 (on) or 0 (off)")


def hierarchical() -> tuple[bool | None, bool | None]:
    """``HOROVOD_HIERARCHICAL_ALLREDUCE`` and ``..._ALLGATHER``: on, off, or None (not set)."""
    return switch(ev.HOROVOD_HIERARCHICAL_ALLREDUCE), switch(ev.HOROVOD_HIERARCHICAL_ALLGATHER)
