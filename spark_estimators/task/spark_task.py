"""What runs inside one Spark barrier task: register, start the rank process, supervise it.

The task registers with the driver service, receives its rank settings, and starts the user's
function in a **fresh child process** (see DECISIONS: isolation of CUDA_VISIBLE_DEVICES, MPI init,
kills). It streams the child's stdout/stderr to the driver line by line, watches the driver's
abort flag and kills the child's whole process group when the job is aborted, and reports a
child that died without reporting (e.g. SIGKILL) as a failure of its rank.

The child's connection details and the job secret reach it through its stdin pipe, never the
command line or the environment; stdin stays open as a lifeline: when this task dies, the child
sees EOF and kills itself.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from spark_estimators import envvars as ev
from spark_estimators._base.ports import reserve_port, reserved_port
from spark_estimators._base.processes import (
    RankProcess,
    exit_words,
    kill_group,
    start_rank_process,
)
from spark_estimators.driver.rpc import RpcClient
from spark_estimators.errors import DriverUnreachableError, RemoteError
from spark_estimators.task import spare
from spark_estimators.task.scratch import create_scratch, remove_scratch

if TYPE_CHECKING:
    from pyspark import TaskContext

STDERR_TAIL_LINES = 40
WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class TaskConfig:
    """Everything a Spark task needs; shipped in the Spark closure (no function, no data)."""

    driver_address: tuple[str, int]
    secret: bytes
    job_id: str
    start_timeout: float
    backend: str = "auto"
    use_gpu: bool | None = None
    # data="stream": the task spills its input partition for its rank (task/stream_spill.py).
    stream: Any = None
    # Modules the executor's zygote imports ahead (task/spare.py); () starts plain processes.
    preimport: tuple[str, ...] = ()

    def __repr__(self) -> str:  # never print the secret
        return f"TaskConfig(driver={self.driver_address}, job={self.job_id})"


def host_hash(executor_address: str = "") -> str:
    """Hostname plus the optional salt that splits one machine into several logical hosts.

    ``{executor}`` in the salt is replaced by the task's executor address, so
    ``spark.executorEnv.SPARK_ESTIMATORS_HOST_HASH_SALT={executor}`` makes every executor a
    host of its own (how the tests get ``cross_rank > 0`` on one machine).
    """
    salt = os.environ.get(ev.HOST_HASH_SALT, "").replace("{executor}", executor_address)
    name = socket.gethostname()
    if not salt:
        return name
    return name + "-" + hashlib.sha1(salt.encode()).hexdigest()[:8]


def connect_driver(config: TaskConfig, index: int) -> RpcClient:
    """Connect this task to the driver service, or raise an error naming this host and address.

    The connect alone may take half the start timeout (at least 5 s): a host whose packets to
    the driver are dropped then fails its Spark task, and the driver reports that error, before
    the driver's own ``start_timeout`` would call it a rendezvous timeout.
    """
    host, port = config.driver_address
    try:
        return RpcClient(
            config.driver_address,
            config.secret,
            timeout=config.start_timeout + 30,
            connect_timeout=max(5.0, config.start_timeout / 2),
        )
    except OSError as exc:
        raise DriverUnreachableError(
            f"task {index} on host {socket.gethostname()!r} cannot reach the driver service at "
            f"{host}:{port} ({exc}): every executor host must reach the driver's address; check "
            f"firewalls and routes, or pass driver_host= (or set {ev.DRIVER_HOST}) to an "
            "address this host can reach"
        ) from exc


def rank_environment(settings: Any, gpus: tuple[str, ...], backend: str) -> dict[str, str]:
    """Environment of one rank process: torchrun's variables, horovodrun's and ours."""
    env = {
        ev.MASTER_ADDR: settings.master_addr,
        ev.MASTER_PORT: str(settings.master_port),
        ev.RANK: str(settings.rank),
        ev.WORLD_SIZE: str(settings.size),
        ev.LOCAL_RANK: str(settings.local_rank),
        ev.LOCAL_WORLD_SIZE: str(settings.local_size),
        ev.GROUP_RANK: str(settings.cross_rank),
        ev.SE_RANK: str(settings.rank),
        ev.SE_SIZE: str(settings.size),
        ev.SE_LOCAL_RANK: str(settings.local_rank),
        ev.SE_LOCAL_SIZE: str(settings.local_size),
        ev.SE_CROSS_RANK: str(settings.cross_rank),
        ev.SE_CROSS_SIZE: str(settings.cross_size),
        ev.SE_MASTER_ADDR: settings.master_addr,
        ev.SE_MASTER_PORT: str(settings.master_port),
        ev.SE_BACKEND: backend,
        ev.SE_HOSTNAME: settings.host_hash,
        "PYTHONUNBUFFERED": "1",
    }
    if backend != "mpi":
        # horovodrun sets these under Gloo only (under MPI code reads mpirun's PMI_RANK ...).
        horovod = (
            settings.rank,
            settings.size,
            settings.local_rank,
            settings.local_size,
            settings.cross_rank,
            settings.cross_size,
        )
        env.update(zip(ev.HOROVOD_RANK_VARS, map(str, horovod)))
    if gpus:
        # The rank sees the job's GPUs on its host in local-rank order (settings.host_gpus):
        # cuda:local_rank is its own GPU (horovod's set_device idiom), peers stay visible for
        # NCCL's peer-to-peer paths; get_available_devices() answers Spark's addresses and
        # get_device() finds them in the list (docs/clusters.md, "GPUs").
        visible = getattr(settings, "host_gpus", ()) or gpus
        env[ev.CUDA_VISIBLE_DEVICES] = ",".join(visible)
        env[ev.SE_GPU_ADDRESSES] = ",".join(gpus)
    return env


def task_gpus(ctx: TaskContext, use_gpu: bool | None) -> tuple[str, ...]:
    """The GPU addresses Spark assigned to this task (none when ``use_gpu`` is False)."""
    if use_gpu is False:
        return ()
    try:
        resources = ctx.resources()
    except Exception:
        return ()
    gpu = resources.get("gpu")
    return tuple(gpu.addresses) if gpu is not None else ()


def write_child_config(stream: IO[bytes], config: dict[str, Any]) -> None:
    """Send the rank's settings to its child: a length-prefixed pickle on its stdin."""
    blob = pickle.dumps(config)
    stream.write(struct.pack("!I", len(blob)) + blob)
    stream.flush()


class OutputForwarder:
    """Reads a child's stdout/stderr and sends the lines to the driver in batches."""

    def __init__(self, client: RpcClient, rank: int):
        self._client = client
        self._rank = rank
        self._queue: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self.stderr_tail: list[str] = []
        self._sender = threading.Thread(target=self._send_loop, daemon=True)
        self._sender.start()
        self._readers: list[threading.Thread] = []

    def attach(self, pipe: IO[bytes], stream: str) -> None:
        """Forward the lines of ``pipe`` (the child's ``stream``) from a reader thread."""
        t = threading.Thread(target=self._read_loop, args=(pipe, stream), daemon=True)
        t.start()
        self._readers.append(t)

    def _read_loop(self, pipe: IO[bytes], stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if stream == "stderr":
                self.stderr_tail.append(line)
                del self.stderr_tail[:-STDERR_TAIL_LINES]
            self._queue.put((stream, line))
        pipe.close()

    def _send_loop(self) -> None:
        done = False
        while not done:
            item = self._queue.get()
            batch = [item]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            by_stream: dict[str, list[str]] = {}
            for entry in batch:
                if entry is None:
                    done = True
                    continue
                by_stream.setdefault(entry[0], []).append(entry[1])
            for stream, lines in by_stream.items():
                try:
                    self._client.call("log", {"rank": self._rank, "stream": stream, "lines": lines})
                except Exception:
                    return

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the readers to reach EOF, then send what is left and stop the sender."""
        for t in self._readers:
            t.join(timeout)
        self._queue.put(None)
        self._sender.join(timeout)


ABORT_REAP_S = 0.5


def _abort_child(proc: RankProcess, aborted: threading.Event) -> None:
    """Kill the rank because the job aborts.

    Only a rank that was still alive counts as aborted: one that died on its own (the cause of
    the abort) is still reported as the failure it is. The abort can arrive while the task's
    main thread is still reaping that rank (``poll()`` then answers None), so it waits briefly.
    """
    try:
        proc.wait(timeout=ABORT_REAP_S)
    except subprocess.TimeoutExpired:
        aborted.set()
    kill_group(proc)


def watch_abort(
    config: TaskConfig,
    proc: RankProcess,
    stop: threading.Event,
    aborted: threading.Event,
) -> None:
    """Kill the child's process group when the driver aborts the job or becomes unreachable."""
    try:
        client = RpcClient(config.driver_address, config.secret, timeout=WATCH_INTERVAL_S + 30)
    except OSError:
        kill_group(proc)
        return
    try:
        while not stop.is_set() and proc.poll() is None:
            reply = client.call("watch", WATCH_INTERVAL_S)
            if reply["abort"] is not None:
                _abort_child(proc, aborted)
                return
    except Exception:
        if not stop.is_set():
            _abort_child(proc, aborted)
    finally:
        client.close()


def describe_exit(code: int) -> str:
    """A rank process's end in words, for a rank that did not report a result."""
    words = exit_words(code)
    return f"the rank process {words}" + ("" if code < 0 else " without reporting a result")


def run_rank(
    index: int,
    attempt: int,
    gpus: tuple[str, ...],
    config: TaskConfig,
    executor_address: str = "",
    task_started: float | None = None,
    stream_fifo: str | None = None,
    outcome: dict[str, Any] | None = None,
) -> int:
    """Register with the driver, run the rank process to completion, report; returns the rank.

    ``stream_fifo`` (``data="stream"``): the path of the spill's notification FIFO, which the
    rank process opens (a forked rank can take it); ``outcome`` receives the rank process's exit
    ``code``.

    Every task offers a port it holds (:func:`~spark_estimators._base.ports.reserve_port`); the
    driver advertises rank 0's as ``MASTER_PORT``. Rank 0's task keeps holding it until its rank
    process has exited, so no other process can take the port before the rank's store binds it.
    """
    client = connect_driver(config, index)
    scratch: str | None = None
    reservation = reserve_port()
    try:
        hostname = socket.gethostname()
        reg = {
            "index": index,
            "host": hostname,
            "host_hash": host_hash(executor_address),
            "pid": os.getpid(),
            "address": client.local_address(),
            "port": reserved_port(reservation),
            "gpus": gpus,
            "attempt": attempt,
        }
        reply = client.call("register", reg)
        task_marks = [("registered", time.time())]
        settings = reply["settings"]
        if settings.rank != 0:
            reservation.close()  # rank 0's task holds the rendezvous port
        env = dict(os.environ)
        env.update(rank_environment(settings, gpus, config.backend))
        env.update(reply["env"])
        for name in reply.get("unset", ()):  # e.g. another MPI launcher's PMI_FD
            env.pop(name, None)
        scratch = create_scratch(env)  # removed below even when the rank was killed
        if stream_fifo is not None:
            from spark_estimators.task.stream_spill import STREAM_FD_ENV, STREAM_FIFO_ENV

            env[STREAM_FIFO_ENV] = stream_fifo
            env.pop(STREAM_FD_ENV, None)  # the rank names the fd it opens
        child_config = {
            "driver_address": config.driver_address,
            "secret": config.secret,
            "rank": settings.rank,
            "task_started": task_started,
            "task_marks": task_marks,
        }
        forked = spare.take(config.preimport, env)  # the executor's zygote (task/spare.py)
        proc: RankProcess
        if forked is not None:  # it has the modules imported; it takes the env on stdin
            proc, child_config["env"] = forked, env
        else:
            proc = start_rank_process("spark_estimators.task.child", env)
        task_marks.append(("spare_forked_for" if forked else "process_started", time.time()))
        code, aborted, tail_lines = supervise_child(
            config, client, proc, settings.rank, child_config
        )
        remove_scratch(scratch)  # before the job can end: the driver sees it gone on return
        if outcome is not None:
            outcome["code"] = code
        if code != 0 and not aborted:
            tail = "\n".join(tail_lines)
            client.call(
                "failure",
                RemoteError(
                    rank=settings.rank,
                    host=hostname,
                    message=describe_exit(code),
                    traceback=("last stderr lines:\n" + tail) if tail else "",
                    exit_code=code,
                ).__dict__,
            )
        client.call("task_done", index)
        return int(settings.rank)
    finally:
        remove_scratch(scratch)  # a no-op when already removed above
        reservation.close()  # the rank process that used the port has exited
        client.close()


def supervise_child(
    config: TaskConfig,
    client: RpcClient,
    proc: RankProcess,
    label: int,
    child_config: dict[str, Any],
) -> tuple[int, bool, list[str]]:
    """Hand a started rank process its config and supervise it to its end.

    Its output streams to the driver prefixed with ``label``; a watcher kills it when the driver
    aborts the job. After it exits its process group is killed (no grandchild stays behind).
    Returns the exit code, whether the driver aborted it, and the last lines of its stderr.
    """
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    forwarder = OutputForwarder(client, label)
    forwarder.attach(proc.stdout, "stdout")
    forwarder.attach(proc.stderr, "stderr")
    stop, aborted = threading.Event(), threading.Event()
    watcher = threading.Thread(target=watch_abort, args=(config, proc, stop, aborted), daemon=True)
    watcher.start()
    try:
        write_child_config(proc.stdin, child_config)
    except BrokenPipeError:
        pass
    code = proc.wait()
    stop.set()
    kill_group(proc)
    try:
        proc.stdin.close()
    except OSError:
        pass
    forwarder.close()
    return code, aborted.is_set(), forwarder.stderr_tail


def barrier_task(config: TaskConfig, batches: Iterator[Any]) -> Iterator[Any]:
    """The ``mapInArrow(..., barrier=True)`` function: one rank per Spark partition."""
    started = time.time()
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    index = ctx.partitionId()
    gpus = task_gpus(ctx, config.use_gpu)
    try:
        executor_address = ctx.getTaskInfos()[index].address
    except Exception:
        executor_address = ""
    spare.ensure(config.preimport)  # a zygote's imports overlap the registration of all ranks
    copy_report = ""  # data="parquet+stream": the task's share of the Parquet copy
    try:
        if config.stream is not None:  # the partition is the rank's data: spilled as it trains
            from spark_estimators.task.stream_spill import run_streaming_rank

            def start(fifo: str, outcome: dict[str, Any]) -> int:
                attempt = ctx.attemptNumber()
                args = (executor_address, started, fifo, outcome)
                return run_rank(index, attempt, gpus, config, *args)

            rank, copy_report = run_streaming_rank(config.stream, batches, ctx, start)
        else:
            for _ in batches:  # consume the (tiny) input partition
                pass
            rank = run_rank(index, ctx.attemptNumber(), gpus, config, executor_address, started)
    finally:
        spare.ensure(config.preimport)  # for the next fit this worker runs (if it died)
    yield pa.RecordBatch.from_pydict(
        {
            "index": [index],
            "rank": [rank],
            "seconds": [time.time() - started],
            "copy": [copy_report],
        }
    )
