"""The errors the collective engine settles a failed op with (see :mod:`.engine`)."""

from __future__ import annotations

import logging
import re

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import Backend
from spark_estimators.collective.runtime.requests import Request
from spark_estimators.errors import CollectiveError

logger = logging.getLogger("spark_estimators.collective.runtime.engine")


def broken_error(request: Request, broken: CollectiveError, backend: Backend) -> CollectiveError:
    """Why ``request`` did not run: the group broke at an earlier op (``broken``)."""
    error = CollectiveError(
        f"{request.kind.name.lower()} {request.name!r} not run on rank {backend.rank}: "
        f"the collective group is broken since an earlier op failed ({broken})"
    )
    error.__cause__ = broken
    return error


def backend_error(request: Request, exc: BaseException, backend: Backend) -> CollectiveError:
    """``request`` failed in the backend with ``exc`` (a peer died, the timeout passed)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h)(:\d+)?\]\s*", "", text)  # gloo's source location
    hint = "a peer rank probably died or stopped calling collectives; check its log"
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (
            f"no peer answered within the collective timeout ({backend.timeout:g} s, "
            f"{ev.COLLECTIVE_TIMEOUT})"
        )
    error = CollectiveError(
        f"{request.kind.name.lower()} {request.name!r} failed on rank {backend.rank} "
        f"(backend {backend.name}): {text}; {hint}"
    )
    error.__cause__ = exc
    logger.debug("collective op failed", exc_info=exc)
    return error
