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
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, Any

import cloudpickle

from spark_estimators import envvars as ev
from spark_estimators import run_options
from spark_estimators._base.console_bar import SPARK_CONSOLE_BAR
from spark_estimators._base.environ import validate_env
from spark_estimators._base.output import OutputPrinter
from spark_estimators._base.pickling import pickle_payload
from spark_estimators._base.session import (
    available_task_slots,
    cancel_job_group,
    default_num_proc,
    driver_service_host,
    end_job_group,
    get_spark,
    spark_master,
    start_job_group,
)
from spark_estimators.driver.frames import new_secret
from spark_estimators.driver.service import DriverService, JobState, is_consequence
from spark_estimators.errors import (
    ConfigurationError,
    RendezvousTimeoutError,
    TrainingFailedError,
)
from spark_estimators.task import spare

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0
ADMISSION_WAIT_S = 30.0

EventCallback = Callable[[int, str, Any], None]


def _resolve_backend(backend: str | None, use_mpi: bool | None, use_gloo: bool | None) -> str:
    if use_mpi and use_gloo:
        raise ConfigurationError("use_mpi=True and use_gloo=True conflict: choose one backend")
    if use_mpi:
        return "mpi"
    if use_gloo:
        return "gloo"
    return run_options.check_backend(backend or "auto")


def check_admission(spark: Any, num_proc: int, wait_s: float = 0.0) -> None:
    """Fail fast when the cluster cannot run ``num_proc`` tasks at once (barrier mode).

    On a cluster, executors that are still starting get up to ``wait_s`` seconds to register.
    """
    slots = available_task_slots(spark, needed=num_proc, wait_s=wait_s)
    if slots is not None and num_proc > slots:
        raise ConfigurationError(
            f"num_proc={num_proc} needs {num_proc} concurrent Spark task slots, but the cluster "
            f"(master {spark_master(spark)!r}) has {slots}. Use num_proc<={slots}, or add "
            f"executors/cores (e.g. master local[{num_proc}], more spark.executor.instances, "
            f"or a lower spark.task.cpus)."
        )


def _spark_job(
    spark: Any,
    num_proc: int,
    task_fn: Any,
    job_id: str,
    box: dict[str, Any],
    svc: DriverService,
    source_df: Any = None,
) -> None:
    try:
        start_job_group(spark, job_id, f"spark_estimators.run {num_proc} ranks")
        # data="stream": the tasks map over the training data itself (one partition per rank).
        df = spark.range(num_proc, numPartitions=num_proc) if source_df is None else source_df
        out = df.mapInArrow(task_fn, "index long, rank long, seconds double", barrier=True)
        box["rows"] = out.collect()
    except BaseException as exc:
        box["error"] = exc
    finally:
        try:
            end_job_group(spark, job_id)
        except Exception as exc:  # the session may be gone after an interrupt
            logger.debug("could not clear the job tag %s: %s", job_id, exc)
        box["done"] = True
        svc.notify()


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
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
    spark: Any = None,
    event_callback: EventCallback | None = None,
    nics: str | Sequence[str] | None = None,
    timeline: str | None = None,
    extra_mpi_args: str | None = None,
    executable: str | None = None,
    driver_host: str | None = None,
    stream_input: Any = None,
) -> list[Any]:
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
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, list | tuple):
        raise ConfigurationError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigurationError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    collective_backend = _resolve_backend(backend, use_mpi, use_gloo)
    run_options.check_unsupported("run", extra_mpi_args=extra_mpi_args, executable=executable)
    extra_env = validate_env(run_options.rank_env(env, nics=nics, timeline=timeline))
    timeout = ev.start_timeout() if start_timeout is None else float(start_timeout)
    if timeout <= 0:
        raise ConfigurationError(f"start_timeout must be > 0 seconds, got {start_timeout!r}")

    spark = get_spark(spark)
    if num_proc is None:
        num_proc = default_num_proc(spark)
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ConfigurationError(f"num_proc must be a positive int, got {num_proc!r}")
    check_admission(spark, num_proc, wait_s=min(timeout, ADMISSION_WAIT_S))

    payload = pickle_payload(fn, tuple(args), dict(kwargs or {}))
    job_id = "spark_estimators-" + uuid.uuid4().hex[:12]
    secret = new_secret()
    driver_host = driver_service_host(spark, driver_host)
    svc = DriverService(
        num_proc,
        secret,
        payload,
        env=extra_env,
        host=driver_host,
        output=OutputPrinter(stdout, stderr, prefix_output_with_timestamp),
        events=event_callback,
    )
    pmi = None
    if collective_backend == "mpi":  # the driver serves PMI: the ranks form one MPI_COMM_WORLD
        from spark_estimators.driver.pmi import serve_mpi_job

        pmi = serve_mpi_job(svc, driver_host)
    launcher = _Launch(
        spark, svc, num_proc, job_id, timeout, collective_backend, use_gpu, secret, stream_input
    )
    launcher.preimport(spare.preimports(fn))  # the estimators' ranks: spare processes
    # The barrier stage's bar says nothing while ranks run ("(0 + n) / n" until they end) and
    # Spark draws it over the ranks' forwarded lines: muted for the job, restored after it.
    SPARK_CONSOLE_BAR.mute()
    try:
        return launcher.run(verbose)
    finally:
        SPARK_CONSOLE_BAR.unmute()
        if pmi is not None:
            pmi.close()
        svc.close()


class _Launch:
    """One launch of a barrier job, waited on from the calling thread."""

    def __init__(
        self,
        spark: Any,
        svc: DriverService,
        num_proc: int,
        job_id: str,
        start_timeout: float,
        backend: str,
        use_gpu: bool | None,
        secret: bytes,
        stream_input: Any = None,
    ):
        from spark_estimators.task.spark_task import TaskConfig, barrier_task

        self.spark, self.svc, self.num_proc, self.job_id = spark, svc, num_proc, job_id
        self.start_timeout = start_timeout
        self.source_df, stream = None, None
        if stream_input is not None:
            from spark_estimators.task.stream_spill import StreamTaskSettings

            self.source_df = stream_input.dataframe
            stream = StreamTaskSettings(split_col=stream_input.split_col)
        config = TaskConfig(
            driver_address=svc.address,
            secret=secret,
            job_id=job_id,
            start_timeout=start_timeout,
            backend=backend,
            use_gpu=use_gpu,
            stream=stream,
        )
        self.config = config
        self.task_fn = partial(barrier_task, config)
        self.box: dict[str, Any] = {"done": False}

    def preimport(self, modules: tuple[str, ...]) -> None:
        """Let the tasks adopt spare rank processes with ``modules`` imported (task/spare.py)."""
        from dataclasses import replace

        from spark_estimators.task.spark_task import barrier_task

        self.config = replace(self.config, preimport=modules)
        self.task_fn = partial(barrier_task, self.config)

    def run(self, verbose: int) -> list[Any]:
        if verbose >= 1:
            logger.info("launching %d ranks (job %s)", self.num_proc, self.job_id)
        thread = threading.Thread(
            target=_spark_job,
            args=(
                self.spark,
                self.num_proc,
                self.task_fn,
                self.job_id,
                self.box,
                self.svc,
                self.source_df,
            ),
            name="se-spark-job",
            daemon=True,
        )
        started = time.monotonic()
        thread.start()
        try:
            self._wait_started(started)
            self.svc.wait(lambda s: self.box["done"] or s.abort_reason is not None, timeout=None)
        except RendezvousTimeoutError:
            self._stop(thread, "start_timeout expired", grace=0.0)
            raise
        except BaseException:
            # KeyboardInterrupt (a notebook interrupt): stop every rank and the Spark job.
            self._stop(thread, "interrupted on the driver", grace=0.0)
            raise
        if self.svc.state.abort_reason is not None:
            self._stop(thread, self.svc.state.abort_reason)
        return self._collect_results()

    def _wait_started(self, started: float) -> None:
        if self.source_df is not None:
            # The barrier stage starts after the data's shuffle stage, however long that takes.
            self.svc.wait(
                lambda s: bool(s.registrations) or s.abort_reason is not None or self.box["done"],
                timeout=None,
            )
            started = time.monotonic()
        deadline = started + self.start_timeout

        def registered_or_over(s: JobState) -> bool:
            return bool(s.settings) or s.abort_reason is not None or self.box["done"]

        if not self.svc.wait(registered_or_over, timeout=max(0.0, deadline - time.monotonic())):
            registered = sorted(self.svc.state.registrations)
            host, port = self.svc.address
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
                f"only {len(registered)} of {self.num_proc} Spark tasks registered within "
                f"start_timeout={self.start_timeout:g}s ({self.svc.registered_summary()}). " + hint,
                registered=registered,
                expected=self.num_proc,
            )

    def _stop(self, thread: threading.Thread, reason: str, grace: float = ABORT_GRACE_S) -> None:
        self.svc.abort(reason)
        # Tasks kill their rank processes as soon as they see the abort, then return normally;
        # cancelling the job group is the fallback (and the only way for tasks not yet started).
        self.svc.wait(lambda s: self.box["done"], timeout=grace)
        if not self.box["done"]:
            try:
                cancel_job_group(self.spark, self.job_id)
            except Exception as exc:
                logger.warning("could not cancel Spark job group %s: %s", self.job_id, exc)
            thread.join(ABORT_GRACE_S)

    def _collect_results(self) -> list[Any]:
        state = self.svc.state
        if state.failures:
            # A rank that dies makes its peers raise CollectiveError: name the cause first.
            primary = [r for r, f in state.failures.items() if not is_consequence(f.message)]
            ranks = ", ".join(str(r) for r in sorted(primary or state.failures))
            raise TrainingFailedError(
                f"rank {ranks} failed ({len(state.failures)} of {self.num_proc} ranks reported "
                "a failure); the other ranks were stopped",
                dict(state.failures),
            )
        if "error" in self.box:
            raise TrainingFailedError(
                f"the Spark barrier job failed: {self.box['error']}"
            ) from self.box["error"]
        missing = [r for r in range(self.num_proc) if r not in state.results]
        if missing:
            raise TrainingFailedError(f"ranks {missing} finished without reporting a result")
        return [cloudpickle.loads(state.results[r]) for r in range(self.num_proc)]
