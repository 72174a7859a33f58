"""Horovod's ``horovod.torch.mpi_ops`` import path, for code ported by changing imports only.

``from horovod.torch.mpi_ops import synchronize`` (horovod's own tests do this) becomes
``from spark_estimators.collective.torch.mpi_ops import synchronize``; every name of
:mod:`spark_estimators.collective.torch` is here.
"""

from __future__ import annotations

from spark_estimators.collective import torch as _hvd
from spark_estimators.collective.torch import *  # noqa: F403

__all__ = list(_hvd.__all__)
