"""Old import path, kept for existing code.

The module is now :mod:`spark_estimators.collective.api.elastic`.

Horovod's ``hvd.elastic``, framework-free (``State``, ``ObjectState``, ``run``).
"""

from __future__ import annotations

from spark_estimators.collective.api import elastic as _module
from spark_estimators.collective.api.elastic import *  # noqa: F403

__all__ = list(_module.__all__)
