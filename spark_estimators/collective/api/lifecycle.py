"""Joining and leaving the collective group, and what a rank knows about it.

:func:`init` picks the backend (:mod:`spark_estimators.collective.backends`), starts the engine
(:mod:`spark_estimators.collective.runtime.engine`) and, when asked, the timeline;
:func:`rank`, :func:`size` and the rest read the topology of the active group. Re-exported by
:mod:`spark_estimators.collective` and the framework adapters.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from spark_estimators.collective.api import timeline as _timeline
from spark_estimators.collective.backends.base import Topology, backend_class
from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import process_sets as _process_sets
from spark_estimators.collective.runtime import settings as _settings
from spark_estimators.collective.runtime import tuning as _tuning
from spark_estimators.collective.runtime.forms import named
from spark_estimators.collective.runtime.process_sets import ProcessSet, add_process_set
from spark_estimators.errors import ConfigurationError

logger = logging.getLogger(__name__)

_atexit_registered = False

if TYPE_CHECKING:
    from mpi4py import MPI


def init(
    backend: str | None = None,
    *,
    comm: MPI.Intracomm | Sequence[int] | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
    timeline: str | None = None,
) -> None:
    """Join the collective group of this job; call once per process before any op.

    Parameters
    ----------
    backend
        ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"auto"`` (under ``mpiexec``: mpi; else nccl when
        this rank has a CUDA device, else gloo). Default: ``SPARK_ESTIMATORS_BACKEND`` (set by
        the launchers), else auto.
    comm
        MPI only, as ``hvd.init(comm=...)``: an mpi4py intracommunicator, or a list of
        ``COMM_WORLD`` ranks, to run the collectives on instead of ``COMM_WORLD``; rank, size
        and local ranks are then this communicator's. Implies ``backend="mpi"``.
    start_timeout
        Seconds to wait for every rank at the rendezvous; default
        ``SPARK_ESTIMATORS_START_TIMEOUT`` (60).
    timeout
        Seconds an op waits for its peers before raising; default
        ``SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT`` (120).
    process_sets
        :class:`ProcessSet` objects to register right away (the same list on every rank), as
        Horovod's static process sets; ``"dynamic"`` is accepted (sets can always be added
        later with :func:`add_process_set`).
    timeline
        Write this rank's timeline (Chrome trace JSON of every op and its negotiation) to this
        path, ``.rank<N>`` added before the extension (or ``{rank}`` replaced); default
        ``SPARK_ESTIMATORS_TIMELINE``, else ``HOROVOD_TIMELINE`` (``DYNAMIC``: none now, start
        one later with ``start_timeline``). See :mod:`spark_estimators.collective.api.timeline`.

    Raises
    ------
    ConfigurationError
        Bad backend name or environment.
    RendezvousTimeoutError
        Not every rank reached the rendezvous within ``start_timeout``.

    Notes
    -----
    Calling ``init()`` again while initialised does nothing (as in Horovod).
    """
    global _atexit_registered
    with _engine.lock():
        if _engine.current() is not None:
            return
        if isinstance(process_sets, str) and process_sets != "dynamic":
            raise ConfigurationError(
                f"init(process_sets={process_sets!r}): pass a list of ProcessSet objects or "
                "'dynamic'"
            )
        requested = _settings.requested_backend(backend)
        extra: dict[str, MPI.Intracomm | Sequence[int]] = {}
        if comm is not None:
            if backend not in (None, "auto", "mpi"):
                raise ConfigurationError(
                    f"init(comm=...) is an MPI communicator, but backend={backend!r}; use "
                    "backend='mpi' (or leave it out)"
                )
            requested, extra = "mpi", {"comm": comm}
        name = _settings.resolve_backend(requested)
        # The MPI backend takes its rank and size from the communicator: no rendezvous address.
        topology = _settings.topology_from_env(rendezvous=name != "mpi")
        if name == "nccl":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            name = _settings.backend_for_host(name, requested, topology, gpus)
        cls = backend_class(name)
        impl = cls(
            topology,
            timeout=_settings.collective_timeout(timeout),
            start_timeout=_settings.start_timeout(start_timeout),
            **extra,
        )
        impl.start()
        impl = _tuning.hierarchical_backend(impl)
        engine = _engine.Engine(impl)
        path = _settings.timeline_path(timeline)
        if path:
            engine.timeline = _timeline.Timeline(path, impl.topology.rank)
        _tuning.start_autotune(engine)
        engine.start()
        _engine.install(engine)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        topology = impl.topology  # the MPI backend may have refined it
        log = logger.info if topology.rank == 0 else logger.debug
        log("collective init: rank %d of %d, backend %s", topology.rank, topology.size, name)
        for var, why in _settings.ignored_horovod_variables().items():
            (logger.warning if topology.rank == 0 else logger.debug)(
                "%s is set but has no effect in spark_estimators: %s", var, why
            )
        if process_sets is not None and not isinstance(process_sets, str):
            for ps in process_sets:
                add_process_set(ps)


def shutdown() -> None:
    """Leave the collective group (no-op when not initialised); ``init()`` may follow."""
    with _engine.lock():
        engine = _engine.current()
        if engine is None:
            return
        _process_sets.shutdown_all()
        _engine.install(None)
        stopped = engine.stop(timeout=engine.backend.timeout + 5.0)
        if engine.timeline is not None:
            engine.timeline.close()
        if stopped:
            engine.backend.shutdown()
        else:
            logger.warning("collective engine still busy at shutdown; group left as is")


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _engine.current() is not None


def _topology(op: str) -> Topology:
    return _engine.require(op).backend.topology


def _topology_number(field: str, doc: str) -> Callable[[], int]:
    """The query ``field()``: the topology's number of that name (``rank()``, ``size()`` ...)."""

    def query() -> int:
        return int(getattr(_topology(field), field))

    return named(query, field, doc)


rank = _topology_number("rank", "Rank of this process, ``0 .. size() - 1``.")
size = _topology_number("size", "Number of ranks in the job.")
local_rank = _topology_number("local_rank", "Rank among the processes on this host.")
local_size = _topology_number("local_size", "Number of ranks on this host.")
cross_rank = _topology_number(
    "cross_rank", "Rank among the processes with this ``local_rank`` across hosts (the host index)."
)
cross_size = _topology_number(
    "cross_size",
    "Number of processes with this ``local_rank`` across hosts (the number of hosts).",
)


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    topo = _topology("is_homogeneous")
    return topo.local_size * topo.cross_size == topo.size


def backend_name() -> str:
    """Name of the active backend (``"gloo"``, ``"nccl"``, ``"mpi"``)."""
    return _engine.require("backend_name").backend.name


def mpi_threads_supported() -> bool:
    """True only when the MPI backend is active with ``MPI_THREAD_MULTIPLE``."""
    return _engine.require("mpi_threads_supported").backend.mpi_threads_supported()


def mpi_enabled() -> bool:
    """True when the MPI backend is active."""
    return is_initialized() and backend_name() == "mpi"


def gloo_enabled() -> bool:
    """True when the Gloo backend is active (also the CPU half of ``nccl``)."""
    return is_initialized() and backend_name() in ("gloo", "nccl")


def nccl_built() -> int:
    """NCCL's version code when torch has NCCL (a CUDA build), else 0; Horovod's meaning.

    The code is NCCL's ``NCCL_VERSION_CODE`` (``22105`` for 2.21.5; ``2708`` for 2.7.8), so
    Horovod's ``if hvd.nccl_built() and hvd.nccl_built() < 2700`` checks keep working; it is
    truthy exactly when NCCL is there.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return 0
    if not dist.is_nccl_available():
        return 0
    try:
        major, minor, patch = (int(v) for v in torch.cuda.nccl.version()[:3])
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return 1  # NCCL is there but does not say its version: still "built"
    if (major, minor) <= (2, 8):
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """True when torch was built with CUDA (Horovod: built with CUDA support)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True when torch was built with ROCm (HIP)."""
    try:
        import torch
    except ImportError:
        return False
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """Always False: IBM DDL is not a backend here (Horovod dropped it too)."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not a backend here (Horovod's ``ccl_built`` guards skip it)."""
    return False


def gloo_built() -> bool:
    """True when torch has Gloo."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_gloo_available())


def mpi_built() -> bool:
    """True when mpi4py is importable."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None
