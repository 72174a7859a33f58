"""What ``init()`` sets up from Horovod's tuning variables: hierarchical collectives, autotune.

* ``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``HOROVOD_HIERARCHICAL_ALLGATHER`` = 1: the backend is
  wrapped by :class:`~spark_estimators.collective.backends.hierarchical.HierarchicalBackend`
  (when the ranks span hosts with several ranks on one; otherwise nothing changes).
* ``HOROVOD_AUTOTUNE`` = 1: the global engine gets an
  :class:`~spark_estimators.collective.runtime.autotune.Autotune`; the backend is wrapped with
  both switches off when a hierarchical variable is unset, so autotune can try them.

Every rank must see the same values (the launchers give all ranks the same environment): the
wrapping is collective.
"""

from __future__ import annotations

import logging

from spark_estimators import envvars as ev
from spark_estimators.collective.backends import hierarchical
from spark_estimators.collective.backends.base import Backend
from spark_estimators.collective.runtime import autotune, settings
from spark_estimators.collective.runtime.engine import Engine

logger = logging.getLogger(__name__)


def hierarchical_backend(backend: Backend) -> Backend:
    """``backend``, wrapped for hierarchical collectives when the environment asks for them."""
    allreduce, allgather = settings.hierarchical()
    tune = bool(settings.switch(ev.HOROVOD_AUTOTUNE))
    wanted = bool(allreduce) or bool(allgather) or (tune and None in (allreduce, allgather))
    if not wanted or backend.size < 2:
        return backend
    return hierarchical.wrap(backend, allreduce_on=bool(allreduce), allgather_on=bool(allgather))


def start_autotune(engine: Engine) -> None:
    """Give ``engine`` its tuner when ``HOROVOD_AUTOTUNE`` is on (and a knob is left to tune)."""
    if not settings.switch(ev.HOROVOD_AUTOTUNE):
        return
    tuner = autotune.from_env(engine)
    if not tuner.tuned:
        (logger.warning if engine.backend.rank == 0 else logger.debug)(
            "%s is set but every knob it tunes was set by hand; nothing to tune",
            ev.HOROVOD_AUTOTUNE,
        )
        return
    engine.tuner = tuner
