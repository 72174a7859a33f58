"""The public, framework-free collective API.

This package's own names are what every flavour of ``hvd`` shares: the lifecycle and topology
calls (:mod:`.lifecycle`), the reduction ops, process sets and the timeline switches.
:mod:`spark_estimators.collective` adds the numpy ops (:mod:`.numpy_ops`); the torch and Keras
adapters add their tensor ops. The framework-free elastic state (:mod:`.elastic`) and the timeline's
``merge`` (:mod:`.timeline`) are imported from their modules here.
"""

from __future__ import annotations

from spark_estimators.collective.api.lifecycle import (
    backend_name,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from spark_estimators.collective.api.timeline import start_timeline, stop_timeline
from spark_estimators.collective.backends.base import ReduceOp
from spark_estimators.collective.runtime.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM  # allreduce / grouped_allreduce / torch DistributedOptimizer
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "backend_name",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
