"""The torch adapter: ``import spark_estimators.collective.torch as hvd``.

It replaces ``import horovod.torch as hvd``; everything below keeps Horovod's names, arguments
and semantics: ``init``, ``rank``, ``size``, ``local_rank``, ... (shared with
:mod:`spark_estimators.collective`), the tensor ops (``allreduce``/``allreduce_``/
``allreduce_async``/``allreduce_async_``, ``grouped_allreduce``, ``allgather``,
``broadcast``/``broadcast_``, ``alltoall``, ``reducescatter``, ``barrier``, ``join``,
``synchronize``, ``poll``, ``allgather_object``, ``broadcast_object``, ``grouped_allgather``,
``grouped_reducescatter``, ``sparse_allreduce_async``), the build queries (``nccl_built``,
``cuda_built``, ``ccl_built`` ...), ``HorovodInternalError`` (the error of a failed collective op:
:class:`~spark_estimators.errors.CollectiveError` under Horovod's name),
``DistributedOptimizer``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``Compression``, ``SyncBatchNorm`` and process sets (``ProcessSet``, ``add_process_set``,
``remove_process_set``, ``global_process_set``).

>>> import spark_estimators.collective.torch as hvd
>>> hvd.init()  # doctest: +SKIP
>>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # doctest: +SKIP
>>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
"""

from __future__ import annotations

from spark_estimators.collective import api as _api
from spark_estimators.collective.api import *  # noqa: F403
from spark_estimators.collective.api.numpy_ops import allgather_object, broadcast_object
from spark_estimators.collective.runtime.futures import Handle
from spark_estimators.collective.torch import elastic as elastic  # noqa: E402  (hvd.elastic.run)
from spark_estimators.collective.torch.compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)
from spark_estimators.collective.torch.exchange import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    reducescatter,
    reducescatter_async,
)
from spark_estimators.collective.torch.grouped import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    sparse_allreduce_async,
)
from spark_estimators.collective.torch.ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from spark_estimators.collective.torch.optimizer import DistributedOptimizer
from spark_estimators.collective.torch.sync_bn import SyncBatchNorm
from spark_estimators.errors import CollectiveError

#: Horovod's name for the error of a failed collective op (``except hvd.HorovodInternalError``).
HorovodInternalError = CollectiveError

__all__ = [
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "Handle",
    "HorovodInternalError",
    "NoneCompressor",
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
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "elastic",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
__all__ += _api.__all__
