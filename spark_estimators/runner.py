"""``run(fn, ...)``: run a function on ``num_proc`` Spark tasks as ranks of one collective group.

How it works: a driver service (TCP, HMAC-signed frames, per-job secret) is started; a Spark
**barrier** job ``spark.range(n, numPartitions=n).mapInArrow(task, schema, barrier=True)``
gang-schedules one task per rank; each task registers, receives its rank and rendezvous point,
and runs ``fn`` in a fresh child process whose environment carries torchrun's variables (so
``torch.distributed.init_process_group("gloo")`` works unchanged) and ours (read by
:func:`spark_estimators.collective.init`). ``fn``, its arguments and its result travel as
cloudpickle inside the signed RPC, never through the Spark closure.

With ``backend="mpi"`` the driver also serves MPICH's PMI-1 protocol
(:mod:`spark_estimators.driver.pmi`), so the ranks' ``MPI_COMM_WORLD`` is the job (see
``docs/mpi.md``).

Any rank that raises or dies fails the whole job: the other ranks are killed within about a
second, the Spark job group is cancelled, and :class:`TrainingFailedError` names the rank(s),
host(s) and remote traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, Protocol, TypeVar, cast

from spark_estimators import envvars as ev
from spark_estimators import run_options
from spark_estimators._base.console_bar import SPARK_CONSOLE_BAR
from spark_estimators._base.session import driver_service_host, get_spark, running_tasks
from spark_estimators.driver.launch_job import (
    ADMISSION_WAIT_S,
    EventCallback,
    LaunchOptions,
    SparkJob,
    check_admission,
    check_call,
    new_job,
    results_by_rank,
    task_config,
)
from spark_estimators.driver.service import (
    DriverService,
    JobState,
    is_consequence,
    silent_ranks,
)
from spark_estimators.errors import (
    ConfigurationError,
    DriverUnreachableError,
    RendezvousTimeoutError,
    TrainingFailedError,
)
from spark_estimators.task import spare
from spark_estimators.task.spark_task import barrier_task
from spark_estimators.task.stream_spill import CopyPlan, StreamTaskSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_GRACE_S = 5.0
#: The barrier stage's result rows.
TASK_SCHEMA = "index long, rank long, seconds double, copy string"

__all__ = ["ADMISSION_WAIT_S", "EventCallback", "check_admission", "launch", "run"]


class StreamSource(Protocol):
    """The estimators' ``data="stream"`` input (``data.stream.StreamInput``)."""

    @property
    def dataframe(self) -> DataFrame:
        """``num_proc`` partitions, one per rank, that the barrier stage maps over."""

    @property
    def split_col(self) -> str | None:
        """The column that flags validation rows, if any."""

    @property
    def copy(self) -> CopyPlan | None:
        """``data="parquet+stream"``: the writer of the store's Parquet copy, else None."""

    def finished(self, reports: list[str]) -> None:
        """Every rank succeeded: each task's copy report (``""`` without a copy)."""


def _resolve_backend(backend: str | None, use_mpi: bool | None, use_gloo: bool | None) -> str:
    if use_mpi and use_gloo:
        raise ConfigurationError("use_mpi=True and use_gloo=True conflict: choose one backend")
    if use_mpi:
        return "mpi"
    if use_gloo:
        return "gloo"
    return backend or "auto"


def run(
    fn: Callable[..., T],
    args: Sequence[object] = (),
    kwargs: dict[str, object] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    use_gpu: bool | None = None,
    prefix_output_with_timestamp: bool = False,
    backend: str = "auto",
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    spark: SparkSession | None = None,
    event_callback: EventCallback | None = None,
    nics: str | Sequence[str] | None = None,
    timeline: str | None = None,
    extra_mpi_args: str | None = None,
    executable: str | None = None,
    driver_host: str | None = None,
    stream_input: StreamSource | None = None,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks; return the results by rank.

    Parameters
    ----------
    fn
        The function each rank runs. It may use ``torch.distributed`` directly (torchrun's
        variables are set) or :mod:`spark_estimators.collective`.
    args, kwargs
        Arguments for ``fn``, shipped with cloudpickle inside the signed RPC.
    num_proc
        Number of ranks; defaults to ``spark.default.parallelism``.
    start_timeout
        Seconds for all tasks to be scheduled and registered (default 60, env
        ``SPARK_ESTIMATORS_START_TIMEOUT``), counted from submission.
    env
        Extra environment variables for the rank processes (they travel inside the RPC).
    stdout, stderr
        File objects that receive the ranks' output, each line prefixed ``[rank]``; default
        ``sys.stdout`` / ``sys.stderr``.
    verbose
        0 is quiet; 1 logs the launch at INFO; 2 at DEBUG level details.
    use_gpu
        None: give ranks the GPUs Spark assigned to their task, if any. False: hide GPUs.
    prefix_output_with_timestamp
        Add a timestamp after the ``[rank]`` prefix.
    backend
        Collective backend the ranks' ``collective.init()`` uses: "auto", "gloo", "nccl", "mpi".
        ``use_mpi`` / ``use_gloo`` are horovod-compatible aliases.
    spark
        The SparkSession; default the active one (or an embedded ``local[2]``).
    event_callback
        ``callback(rank, kind, data)`` for events the ranks send with
        :func:`spark_estimators.task.send_event` (metrics, progress).
    nics
        Horovod's argument: network interface name(s) the ranks' collectives use (sets
        ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` in the ranks).
    timeline
        Write each rank's collective timeline (Chrome trace JSON) to this path on its executor
        (``.rank<N>`` added before the extension).
    extra_mpi_args, executable
        Horovod's arguments with no equivalent: a clear error names the alternative
        (see :mod:`spark_estimators.run_options`).
    driver_host
        Address the executors use to reach this process's driver service (default: env
        ``SPARK_ESTIMATORS_DRIVER_HOST``, else ``spark.driver.host`` for a classic session, or
        for a Spark Connect client this machine's address towards the Connect server).
    stream_input
        Used by the estimators' ``data="stream"``: a
        :class:`~spark_estimators.data.stream.StreamInput` whose DataFrame (``num_proc``
        partitions) the barrier stage maps over; each task spills its partition for its rank
        (:mod:`spark_estimators.task.stream_spill`). ``start_timeout`` then counts from the first
        task's registration, since the stage starts only after the DataFrame's shuffle.

    Returns
    -------
    list
        ``fn``'s return values, index ``i`` from rank ``i``.

    Raises
    ------
    ConfigurationError
        Bad arguments, or ``num_proc`` over the cluster's task slots (checked before any job).
    RendezvousTimeoutError
        Not all tasks started within ``start_timeout``.
    TrainingFailedError
        A rank raised or died; ``worker_failures`` maps rank -> RemoteError with the traceback.

    Examples
    --------
    >>> def fn(magic_number):
    ...     import spark_estimators.collective as hvd
    ...     hvd.init()
    ...     return hvd.rank(), magic_number
    >>> spark_estimators.run(fn, args=(42,), num_proc=2)  # doctest: +SKIP
    [(0, 42), (1, 42)]
    """
    check_call(fn, args, kwargs)
    collective_backend = _resolve_backend(backend, use_mpi, use_gloo)
    run_options.check_unsupported("run", extra_mpi_args=extra_mpi_args, executable=executable)
    options = LaunchOptions(
        num_proc=num_proc,
        start_timeout=start_timeout,
        env=run_options.rank_env(env, nics=nics, timeline=timeline),
        backend=collective_backend,
        verbose=verbose,
        use_gpu=use_gpu,
        stdout=stdout,
        stderr=stderr,
        prefix_output_with_timestamp=prefix_output_with_timestamp,
        driver_host=driver_host,
    )
    return launch(
        options, fn, args, kwargs, spark=spark, event_callback=event_callback,
        stream_input=stream_input,
    )  # fmt: skip


def launch(
    options: LaunchOptions,
    fn: Callable[..., T],
    args: Sequence[object] = (),
    kwargs: dict[str, object] | None = None,
    *,
    spark: SparkSession | None = None,
    event_callback: EventCallback | None = None,
    stream_input: StreamSource | None = None,
) -> list[T]:
    """:func:`run` with its options checked: the launch of ``options.num_proc`` ranks.

    What :class:`~spark_estimators.core.backend.SparkBackend` calls; the arguments are as for
    :func:`run`, and so are the result and the errors.
    """
    spark = get_spark(spark)
    options = options.sized(spark)
    check_admission(spark, options.ranks, wait_s=options.admission_wait_s)
    job = new_job("spark_estimators", fn, args, kwargs)
    driver_host = driver_service_host(spark, options.driver_host)
    svc = DriverService(
        options.ranks,
        job.secret,
        job.payload,
        env=options.environment,
        host=driver_host,
        output=options.output(),
        events=event_callback,
    )
    pmi = None
    if options.backend == "mpi":  # the driver serves PMI: the ranks form one MPI_COMM_WORLD
        from spark_estimators.driver.pmi import serve_mpi_job

        pmi = serve_mpi_job(svc, driver_host)
    stream = None
    if stream_input is not None:
        stream = StreamTaskSettings(stream_input.split_col, copy=stream_input.copy)
    # the estimators' ranks: forked from a zygote with their modules imported (task/spare.py)
    config = task_config(job, svc, options, stream, preimport=spare.preimports(fn))
    # data="stream": the tasks map over the training data itself (one partition per rank).
    tasks = spark.range(options.ranks, numPartitions=options.ranks)
    if stream_input is not None:
        tasks = stream_input.dataframe
    spark_job = SparkJob(
        spark, svc, job.job_id, f"spark_estimators.run {options.ranks} ranks", tasks,
        partial(barrier_task, config), TASK_SCHEMA, barrier=True, join_s=ABORT_GRACE_S,
    )  # fmt: skip
    if options.verbose >= 1:
        logger.info("launching %d ranks (job %s)", options.ranks, job.job_id)
    # The barrier stage's bar says nothing while ranks run ("(0 + n) / n" until they end) and
    # Spark draws it over the ranks' forwarded lines: muted for the job, restored after it.
    SPARK_CONSOLE_BAR.mute()
    try:
        results = _Barrier(spark_job, svc, options, streaming=stream_input is not None).run()
        if stream_input is not None:  # every rank and task succeeded
            stream_input.finished([row["copy"] or "" for row in spark_job.rows])
        return cast("list[T]", results)  # what the ranks' fn returned
    finally:
        SPARK_CONSOLE_BAR.unmute()
        if pmi is not None:
            pmi.close()
        svc.close()


class _Barrier:
    """Waits on one barrier job: every rank registers in time, then all report or one fails."""

    def __init__(
        self, job: SparkJob[JobState], svc: DriverService, options: LaunchOptions, streaming: bool
    ) -> None:
        self.job, self.svc, self.options, self.streaming = job, svc, options, streaming

    def run(self) -> list[object]:
        self.job.start()
        with self.job.stopped_on_error():
            self._wait_started()
            self.job.wait(lambda s: s.abort_reason is not None, timeout=None)
        if self.svc.state.abort_reason is not None:
            self.job.stop(self.svc.state.abort_reason, grace=ABORT_GRACE_S)
        return self._collect_results()

    def _wait_started(self) -> None:
        if self.streaming:
            # The barrier stage starts after the data's shuffle stage, however long that takes.
            self.job.wait(lambda s: bool(s.registrations) or s.abort_reason is not None, None)
        timeout = self.options.timeout

        def registered_or_over(s: JobState) -> bool:
            return bool(s.settings) or s.abort_reason is not None

        if not self.job.wait(registered_or_over, timeout=timeout):
            registered = sorted(self.svc.state.registrations)
            host, port = self.svc.address
            self._raise_if_unreachable(registered, timeout)
            refused = self.svc.server.refusals.describe()
            if refused:
                # Connections were turned away: busy slots or a bad driver_host are not the cause.
                hint = (
                    f"Meanwhile the driver service at {host}:{port} {refused}: something may "
                    "be holding its connection slots or probing it (see docs/security.md); "
                    "keep the driver's ports reachable only from the cluster."
                )
            else:
                hint = (
                    f"The cluster may be busy or short of slots; raise start_timeout (or "
                    f"{ev.START_TIMEOUT}) or lower num_proc. If the tasks run but cannot "
                    f"connect to the driver service at {host}:{port}, pass driver_host= (or "
                    f"set {ev.DRIVER_HOST}) to an address the executors can reach."
                )
            raise RendezvousTimeoutError(
                f"only {len(registered)} of {self.options.ranks} Spark tasks registered within "
                f"start_timeout={timeout:g}s ({self.svc.registered_summary()}). " + hint,
                registered=registered,
                expected=self.options.ranks,
            )

    def _raise_if_unreachable(self, registered: list[int], timeout: float) -> None:
        """Tasks that Spark runs but that never registered: their hosts cannot reach us."""
        if not registered:
            return  # nothing reached us: a bad driver_host or a slow start, as the hint says
        running = running_tasks(self.job.spark, self.job.job_id)
        silent: dict[str, list[int]] = {}
        for index, task_host in sorted(running.items()):
            if index not in registered:
                silent.setdefault(task_host, []).append(index)
        if not silent:
            return
        host, port = self.svc.address
        where = "; ".join(
            f"task {', '.join(map(str, tasks))} on host {h!r}" for h, tasks in silent.items()
        )
        raise DriverUnreachableError(
            f"only {len(registered)} of {self.options.ranks} Spark tasks registered within "
            f"start_timeout={timeout:g}s; {where} run but never reached the driver service at "
            f"{host}:{port}: those hosts cannot reach the driver's address (a firewall or a "
            "route) or their tasks are stuck before connecting; make the address reachable from "
            f"every executor host, or pass driver_host= (or set {ev.DRIVER_HOST}) to one they "
            "can reach",
            registered=registered,
            expected=self.options.ranks,
        )

    def _collect_results(self) -> list[object]:
        state, num_proc = self.svc.state, self.options.ranks
        if state.failures:
            # A rank that dies makes its peers raise CollectiveError: name the cause first.
            primary = [r for r, f in state.failures.items() if not is_consequence(f.message)]
            ranks = ", ".join(str(r) for r in sorted(primary or state.failures))
            # Only peers' timeouts: the ranks that sent nothing are the ones they waited for.
            silent = "" if primary else silent_ranks(state)
            lead = (
                f"{silent} sent neither a result nor an error while the other ranks' "
                "collectives timed out: that host may be cut off the network or down; "
                if silent
                else ""
            )
            raise TrainingFailedError(
                f"{lead}rank {ranks} failed ({len(state.failures)} of {num_proc} ranks reported "
                "a failure); the other ranks were stopped",
                dict(state.failures),
            )
        if self.job.error is not None:
            # A task that gave up connecting to us failed the barrier stage: say that first.
            marker = f"{DriverUnreachableError.__name__}: "
            lines = [ln for ln in str(self.job.error).splitlines() if marker in ln]
            if lines:
                raise DriverUnreachableError(
                    lines[0].split(marker, 1)[1],
                    registered=sorted(state.registrations),
                    expected=num_proc,
                ) from self.job.error
            raise TrainingFailedError(
                f"the Spark barrier job failed: {self.job.error}"
            ) from self.job.error
        missing = [r for r in range(num_proc) if r not in state.results]
        if missing:
            raise TrainingFailedError(f"ranks {missing} finished without reporting a result")
        return results_by_rank(state.results, num_proc)
