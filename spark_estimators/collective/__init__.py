"""Horovod-style collective API, framework-agnostic core: ``init``, ``rank``, ``size``, numpy ops.

The same calls work inside :func:`spark_estimators.run`, inside estimator training code, under
``python -m spark_estimators.launch -np N script.py`` and under ``torchrun``. For torch tensors,
``DistributedOptimizer`` and the rest of ``horovod.torch`` use
:mod:`spark_estimators.collective.torch` (``import spark_estimators.collective.torch as hvd``).

This module imports no deep-learning framework: the ops here take numpy arrays, and the
backend (``gloo``/``nccl`` over torch.distributed, or ``mpi``) is imported by :func:`init`.

>>> import numpy as np
>>> import spark_estimators.collective as hvd
>>> hvd.init()  # doctest: +SKIP
>>> hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum)  # doctest: +SKIP
array([2., 2., 2.], dtype=float32)

The package is layered (see ``docs/architecture.md``), each layer importing only those below:

``api``
    this public API (lifecycle and topology, numpy ops, ``elastic``, ``timeline``);
``runtime``
    the engine thread that negotiates ops across ranks, fuses and runs them, process sets and
    the settings read from the environment;
``backends``
    the :class:`~spark_estimators.collective.backends.Backend` interface and its
    implementations over torch.distributed (gloo, nccl) and mpi4py;
``torch``, ``keras``
    the framework adapters (``import spark_estimators.collective.torch as hvd``).

This module only re-exports :mod:`spark_estimators.collective.api`.
"""

from __future__ import annotations

from spark_estimators.collective import api as _api
from spark_estimators.collective.api import *  # noqa: F403
from spark_estimators.collective.api import numpy_ops as _numpy_ops
from spark_estimators.collective.api.numpy_ops import *  # noqa: F403
from spark_estimators.collective.backends.base import Backend, Topology, register_backend
from spark_estimators.collective.runtime.futures import Handle

__all__ = ["Backend", "Handle", "Topology", "register_backend"]
__all__ += _api.__all__
__all__ += _numpy_ops.__all__
