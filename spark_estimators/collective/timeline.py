"""Old import path, kept for existing code.

The module is now :mod:`spark_estimators.collective.api.timeline`.

The per-rank Chrome trace of the collective ops (``merge`` joins the ranks' files).
"""

from __future__ import annotations

from spark_estimators.collective.api import timeline as _module
from spark_estimators.collective.api.timeline import *  # noqa: F403

__all__ = list(_module.__all__)
