"""Old import path, kept for existing code.

The module is now :mod:`spark_estimators.collective.torch.elastic`.

``TorchState`` and the rest of ``hvd.elastic`` for torch
(``hvd.elastic`` of :mod:`spark_estimators.collective.torch`).
"""

from __future__ import annotations

from spark_estimators.collective.torch import elastic as _module
from spark_estimators.collective.torch.elastic import *  # noqa: F403

__all__ = list(_module.__all__)
