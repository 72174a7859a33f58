"""Old import path, kept for existing code.

The module is now :mod:`spark_estimators.collective.backends`.

Backend authors: the interface is :class:`spark_estimators.collective.backends.Backend`.
"""

from __future__ import annotations

from spark_estimators.collective import backends as _module
from spark_estimators.collective.backends import *  # noqa: F403

__all__ = list(_module.__all__)
