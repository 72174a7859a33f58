"""Collective backends: the :class:`Backend` interface and its registry.

Implementations: :mod:`.torch_distributed` (``gloo`` and ``nccl`` over torch.distributed) and
:mod:`.mpi` (mpi4py). Each is imported only when :func:`spark_estimators.collective.init`
chooses it, so importing this package imports no framework. Backend authors subclass
:class:`Backend` (its module docstring, :mod:`.base`, is the contract) and call
:func:`register_backend`.
"""

from __future__ import annotations

from spark_estimators.collective.backends.base import (
    DTYPES,
    FLOATING_DTYPES,
    Backend,
    Buffer,
    ReduceOp,
    Topology,
    backend_class,
    dtype_code,
    register_backend,
    registered_backends,
    resolve_op,
)

__all__ = [
    "DTYPES",
    "FLOATING_DTYPES",
    "Backend",
    "Buffer",
    "ReduceOp",
    "Topology",
    "backend_class",
    "register_backend",
    "dtype_code",
    "registered_backends",
    "resolve_op",
]
