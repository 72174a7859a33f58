"""The process-wide collective engine: the one ``init()`` installs and every op looks up."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from spark_estimators.errors import CollectiveError, ConfigurationError

if TYPE_CHECKING:
    from spark_estimators.collective.runtime.engine import Engine

_engine: Engine | None = None
_engine_lock = threading.RLock()


def current() -> Engine | None:
    """The running engine, or None before ``init()``."""
    return _engine


def require(op: str, process_set: object = None) -> Engine:
    """The engine that runs ``op``: the global one, or ``process_set``'s.

    Clear errors when ``init()`` has not been called, or this rank is not a member of
    ``process_set`` (a :class:`~spark_estimators.collective.runtime.process_sets.ProcessSet`).
    """
    engine = _engine
    if engine is None:
        raise CollectiveError(
            f"{op}() was called before init(): call spark_estimators.collective.init() "
            "(hvd.init()) in every rank first"
        )
    if process_set is None:
        return engine
    resolve = getattr(process_set, "_require_engine", None)
    if resolve is None:
        raise ConfigurationError(
            f"{op}(process_set={process_set!r}): process_set takes a ProcessSet "
            "(hvd.global_process_set, or one from hvd.add_process_set / init(process_sets=...))"
        )
    return resolve(op)  # type: ignore[no-any-return]


def install(engine: Engine | None) -> None:
    """Set (or clear) the process-wide engine; used by ``init()`` / ``shutdown()``."""
    global _engine
    _engine = engine


def lock() -> threading.RLock:
    """The lock ``init()`` and ``shutdown()`` hold while they change the engine."""
    return _engine_lock
