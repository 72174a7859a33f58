"""The torch adapter: ``import spark_estimators.collective.torch as hvd``.

It replaces ``import horovod.torch as hvd``; everything below keeps Horovod's names, arguments
and semantics: ``init``, ``rank``, ``size``, ``local_rank``, ... (shared with
:mod:`spark_estimators.collective`), the tensor ops (``allreduce``/``allreduce_``/
``allreduce_async``/``allreduce_async_``, ``grouped_allreduce``, ``allgather``,
``broadcast``/``broadcast_``, ``alltoall``, ``reducescatter``, ``barrier``, ``join``,
``synchronize``, ``poll``, ``allgather_object``, ``broadcast_object``),
``DistributedOptimizer``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``Compression`` and ``SyncBatchNorm``.

>>> import spark_estimators.collective.torch as hvd
>>> hvd.init()  # doctest: +SKIP
>>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # doctest: +SKIP
>>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
"""

from __future__ import annotations

from spark_estimators.collective import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    backend_name,
    cross_rank,
    cross_size,
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
    shutdown,
    size,
)
from spark_estimators.collective import torch_elastic as elastic  # noqa: E402  (hvd.elastic.run)
from spark_estimators.collective.engine import Handle
from spark_estimators.collective.torch_compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)
from spark_estimators.collective.torch_ops import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from spark_estimators.collective.torch_optimizer import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from spark_estimators.collective.torch_sync_bn import SyncBatchNorm

__all__ = [
    "Adasum",
    "elastic",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "Handle",
    "Max",
    "Min",
    "NoneCompressor",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "backend_name",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
    "synchronize",
]
