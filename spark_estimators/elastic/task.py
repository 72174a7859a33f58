"""What runs inside one ordinary (non-barrier) Spark task of an elastic job.

The task joins the driver, starts the rank process (``python -m spark_estimators.elastic.worker``)
and supervises it like a fixed-size task does (output forwarding, abort watch, stdin lifeline).
When the rank process fails while the job goes on, the task **raises**, so that Spark retries
it (``spark.task.maxFailures``; ``local[N,F]`` in local mode): the retry joins the driver again
as a new worker and enters the next rendezvous round.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from spark_estimators._base.processes import start_rank_process
from spark_estimators.driver.rpc import RpcClient
from spark_estimators.errors import SparkEstimatorsError
from spark_estimators.task.scratch import create_scratch, remove_scratch
from spark_estimators.task.spark_task import (
    TaskConfig,
    connect_driver,
    describe_exit,
    host_hash,
    supervise_child,
    task_gpus,
)

if TYPE_CHECKING:
    import pyarrow as pa


class ElasticWorkerFailed(SparkEstimatorsError):
    """Raised in the Spark task when its rank process failed, so Spark retries the task."""


def _supervise(
    config: TaskConfig, client: RpcClient, wid: str, index: int, env: dict[str, str]
) -> tuple[int, bool, list[str]]:
    scratch = create_scratch(env)  # the rank's temp dirs, removed when it exits (even killed)
    try:
        return _run_child(config, client, wid, index, env)
    finally:
        remove_scratch(scratch)


def _run_child(
    config: TaskConfig, client: RpcClient, wid: str, index: int, env: dict[str, str]
) -> tuple[int, bool, list[str]]:
    proc = start_rank_process("spark_estimators.elastic.worker", env)
    # output is prefixed with the partition index (the rank changes between rounds)
    return supervise_child(
        config,
        client,
        proc,
        index,
        {
            "driver_address": config.driver_address,
            "secret": config.secret,
            "worker_id": wid,
            "index": index,
            "backend": config.backend,
        },
    )


def run_worker(config: TaskConfig, index: int, attempt: int, gpus: tuple[str, ...]) -> str:
    """Join the driver, run one rank process to its end; raise when Spark should retry."""
    client = connect_driver(config, index)
    try:
        hostname = socket.gethostname()
        reply = client.call(
            "join",
            {
                "index": index,
                "attempt": attempt,
                "host": hostname,
                "host_hash": host_hash(),
                "address": client.local_address(),
                "gpus": gpus,
            },
        )
        if reply["status"] != "ok":
            return "over"
        wid = reply["worker_id"]
        env = dict(os.environ)
        env.update(reply["env"])
        env["PYTHONUNBUFFERED"] = "1"
        if gpus:
            # A worker outlives its rounds, so its CUDA_VISIBLE_DEVICES cannot follow them: it
            # keeps the executor's view (Spark's addresses index it; get_device() finds its own),
            # and local ranks follow the GPU addresses (docs/clusters.md, "GPUs").
            env["SPARK_ESTIMATORS_GPU_ADDRESSES"] = ",".join(gpus)
        code, aborted, tail = _supervise(config, client, wid, index, env)
        retry = False
        if code != 0 and not aborted:
            text = "\n".join(tail)
            answer = client.call(
                "failure",
                {
                    "worker_id": wid,
                    "host": hostname,
                    "message": f"worker {wid}: {describe_exit(code)}",
                    "traceback": ("last stderr lines:\n" + text) if text else "",
                    "exit_code": code,
                },
            )
            retry = bool(answer["retry"])
        client.call("task_done", wid)
        if retry:
            raise ElasticWorkerFailed(
                f"elastic worker {wid} failed ({describe_exit(code)}); Spark retries the task"
            )
        return wid
    finally:
        client.close()


def elastic_task(config: TaskConfig, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: one elastic worker per partition attempt."""
    import pyarrow as pa
    from pyspark import TaskContext

    for _ in batches:
        pass
    ctx = TaskContext.get()
    assert ctx is not None
    worker = run_worker(
        config, ctx.partitionId(), ctx.attemptNumber(), task_gpus(ctx, config.use_gpu)
    )
    yield pa.RecordBatch.from_pydict({"worker": [worker]})
