"""What every launcher of ranks shares: one typed options value and the Spark job skeleton.

Four paths start ranks: :func:`spark_estimators.run` (a barrier stage of ``num_proc`` tasks),
:func:`spark_estimators.run_elastic` (ordinary tasks that Spark retries), the estimators'
:class:`~spark_estimators.core.backend.SparkBackend` (which calls ``run``'s launch) and the local
launcher ``python -m spark_estimators.launch`` (processes on this host, no Spark). They take their
settings as one :class:`LaunchOptions`, checked once, in its ``__post_init__``, where the value
enters (``run()``'s arguments, a ``SparkBackend``'s constructor, the command line).

The Spark paths then follow the same steps, each a piece of this module:

1. :func:`check_call` / :func:`check_admission`: bad input and too few task slots fail in the
   driver before any Spark job.
2. :func:`new_job`: a job id, a per-job secret and the pickled ``(fn, args, kwargs)`` for the
   driver service, which the caller starts (``DriverService`` or ``ElasticDriverService``).
3. :class:`SparkJob`: the Spark job whose tasks are the ranks, run from a thread; the caller
   waits on the driver service (:meth:`SparkJob.wait`), and :meth:`SparkJob.stop` aborts the
   ranks, then cancels the job group (also on a timeout or a notebook interrupt).
4. :func:`results_by_rank`: the ranks' pickled results, in rank order; a failure is raised by
   the caller as :class:`~spark_estimators.errors.TrainingFailedError` (its own wording).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Generic, TypeVar

import cloudpickle

from spark_estimators import envvars as ev
from spark_estimators import run_options
from spark_estimators._base.environ import validate_env
from spark_estimators._base.output import OutputPrinter
from spark_estimators._base.pickling import pickle_payload
from spark_estimators._base.session import (
    available_task_slots,
    cancel_job_group,
    default_num_proc,
    end_job_group,
    spark_master,
    start_job_group,
)
from spark_estimators.driver.frames import new_secret
from spark_estimators.driver.service import JobServiceBase
from spark_estimators.errors import ConfigurationError, RendezvousTimeoutError
from spark_estimators.task.spark_task import TaskConfig
from spark_estimators.task.stream_spill import StreamTaskSettings

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, Row, SparkSession

logger = logging.getLogger(__name__)

#: Seconds the admission check lets executors that are still starting register, at most.
ADMISSION_WAIT_S = 30.0

#: ``callback(rank, kind, data)`` for the events ranks send with ``task.send_event``.
EventCallback = Callable[[int, str, Any], None]
#: The ``mapInArrow`` function of a job's tasks.
TaskFunction = Callable[[Iterator["pa.RecordBatch"]], Iterator["pa.RecordBatch"]]

StateT = TypeVar("StateT")


def positive_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (not a bool), else a ConfigurationError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_seconds(name: str, value: float) -> float:
    """``value`` as a float when it is > 0, else a ConfigurationError naming ``name``."""
    seconds = float(value)
    if seconds <= 0:
        raise ConfigurationError(f"{name} must be > 0 seconds, got {value!r}")
    return seconds


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch the ranks of one job, checked once when built.

    Parameters
    ----------
    num_proc
        Number of ranks; None: the cluster's default (:meth:`sized`).
    start_timeout
        Seconds for every rank to register; None: env ``SPARK_ESTIMATORS_START_TIMEOUT``, else
        60 (read by :attr:`timeout` when the job starts).
    env
        Extra environment variables for the rank processes (str to str).
    backend
        Collective backend name, one of ``envvars.BACKEND_NAMES``.
    verbose
        0 quiet, 1 INFO, 2 DEBUG details.
    use_gpu
        None: the GPUs Spark assigned to the task, if any; False: hide GPUs.
    stdout, stderr, prefix_output_with_timestamp
        Where the ranks' ``[rank]``-prefixed lines go, and whether they get a timestamp.
    driver_host
        Address the executors use to reach the driver service (None: found from the session).

    Examples
    --------
    >>> LaunchOptions(num_proc=2, backend="gloo").num_proc
    2
    >>> LaunchOptions(num_proc=0)
    Traceback (most recent call last):
    ...
    spark_estimators.errors.ConfigurationError: num_proc must be a positive int, got 0
    """

    num_proc: int | None = None
    start_timeout: float | None = None
    env: Mapping[str, str] | None = None
    backend: str = "auto"
    verbose: int = 1
    use_gpu: bool | None = None
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None
    prefix_output_with_timestamp: bool = False
    driver_host: str | None = None

    def __post_init__(self) -> None:
        if self.num_proc is not None:
            positive_int("num_proc", self.num_proc)
        if self.start_timeout is not None:
            seconds = positive_seconds("start_timeout", self.start_timeout)
            object.__setattr__(self, "start_timeout", seconds)
        env = self.env if self.env is None or isinstance(self.env, dict) else dict(self.env)
        object.__setattr__(self, "env", validate_env(env))
        run_options.check_backend(self.backend)

    @property
    def environment(self) -> dict[str, str]:
        """The extra variables of the rank processes (the validated ``env``; may be changed)."""
        assert isinstance(self.env, dict)  # __post_init__ made it one
        return self.env

    @property
    def timeout(self) -> float:
        """``start_timeout``, else the environment's (``SPARK_ESTIMATORS_START_TIMEOUT``)."""
        if self.start_timeout is not None:
            return self.start_timeout
        return positive_seconds(ev.START_TIMEOUT, ev.start_timeout())

    @property
    def admission_wait_s(self) -> float:
        """How long the admission check lets starting executors register."""
        return min(self.timeout, ADMISSION_WAIT_S)

    @property
    def ranks(self) -> int:
        """``num_proc`` of options that went through :meth:`sized`."""
        if self.num_proc is None:
            raise RuntimeError("LaunchOptions.sized(spark) decides num_proc first")
        return self.num_proc

    def sized(self, spark: SparkSession) -> LaunchOptions:
        """These options with ``num_proc`` decided (``spark.default.parallelism`` when None)."""
        if self.num_proc is not None:
            return self
        return dataclasses.replace(self, num_proc=default_num_proc(spark))

    def with_env(self, env: Mapping[str, str] | None) -> LaunchOptions:
        """These options with ``env`` added to (and winning over) the rank variables."""
        if not env:
            return self
        return dataclasses.replace(self, env={**self.environment, **env})

    def output(self) -> OutputPrinter:
        """The printer of the ranks' output lines."""
        return OutputPrinter(self.stdout, self.stderr, self.prefix_output_with_timestamp)


def check_call(fn: object, args: object, kwargs: object) -> None:
    """Raise a ConfigurationError unless ``fn(*args, **kwargs)`` can be shipped to the ranks."""
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, list | tuple):
        raise ConfigurationError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigurationError(f"kwargs must be a dict, got {type(kwargs).__name__}")


def check_admission(
    spark: SparkSession, num_proc: int, wait_s: float = 0.0, hint: str = ""
) -> None:
    """Fail fast when the cluster cannot run ``num_proc`` tasks at once.

    On a cluster, executors that are still starting get up to ``wait_s`` seconds to register.
    ``hint`` replaces the default advice at the end of the message.
    """
    slots = available_task_slots(spark, needed=num_proc, wait_s=wait_s)
    if slots is not None and num_proc > slots:
        advice = hint or (
            f". Use num_proc<={slots}, or add executors/cores (e.g. master local[{num_proc}], "
            "more spark.executor.instances, or a lower spark.task.cpus)."
        )
        raise ConfigurationError(
            f"num_proc={num_proc} needs {num_proc} concurrent Spark task slots, but the cluster "
            f"(master {spark_master(spark)!r}) has {slots}{advice}"
        )


@dataclass(frozen=True)
class NewJob:
    """The identity of one job: its Spark job group, HMAC secret and pickled function."""

    job_id: str
    secret: bytes = dataclasses.field(repr=False)
    payload: bytes = dataclasses.field(repr=False)


def new_job(
    prefix: str,
    fn: Callable[..., object],
    args: Sequence[object],
    kwargs: Mapping[str, object] | None,
) -> NewJob:
    """A fresh job id (``prefix-<hex>``), secret, and the payload ``(fn, args, kwargs)``."""
    payload = pickle_payload(fn, tuple(args), dict(kwargs or {}))
    return NewJob(f"{prefix}-{uuid.uuid4().hex[:12]}", new_secret(), payload)


def task_config(
    job: NewJob,
    service: JobServiceBase[Any],
    options: LaunchOptions,
    stream: StreamTaskSettings | None = None,
    preimport: tuple[str, ...] = (),
) -> TaskConfig:
    """What each Spark task of ``job`` needs to reach ``service`` and start its rank process."""
    return TaskConfig(
        driver_address=service.address,
        secret=job.secret,
        job_id=job.job_id,
        start_timeout=options.timeout,
        backend=options.backend,
        use_gpu=options.use_gpu,
        stream=stream,
        preimport=preimport,
    )


def results_by_rank(results: Mapping[int, bytes], size: int) -> list[object]:
    """The unpickled result of rank 0, 1, ... ``size - 1``."""
    return [cloudpickle.loads(results[rank]) for rank in range(size)]


class SparkJob(Generic[StateT]):
    """The Spark job whose tasks are a job's ranks, run from a thread and waited on.

    Parameters
    ----------
    spark
        The session that runs the job.
    service
        The job's driver service: :meth:`wait` waits on its state, :meth:`stop` aborts it.
    job_id, description
        The Spark job group (cancelled by :meth:`stop`) and its description.
    tasks, task_fn, schema
        The job is ``tasks.mapInArrow(task_fn, schema, barrier=barrier).collect()``.
    barrier
        Gang-schedule the tasks (``run``); False for ``run_elastic``, whose failed tasks Spark
        retries.
    join_s
        Seconds to wait for the job's thread after cancelling the job group.
    """

    def __init__(
        self,
        spark: SparkSession,
        service: JobServiceBase[StateT],
        job_id: str,
        description: str,
        tasks: DataFrame,
        task_fn: TaskFunction,
        schema: str,
        *,
        barrier: bool,
        join_s: float = 5.0,
    ) -> None:
        self.spark, self.service, self.job_id = spark, service, job_id
        self.description, self.join_s = description, join_s
        self._job = (tasks, task_fn, schema, barrier)
        self.done = False
        self.error: BaseException | None = None
        #: The job's result rows once it succeeded (the tasks' reports).
        self.rows: list[Row] = []
        self._thread = threading.Thread(target=self._run, name="se-spark-job", daemon=True)

    def _run(self) -> None:
        tasks, task_fn, schema, barrier = self._job
        try:
            start_job_group(self.spark, self.job_id, self.description)
            self.rows = tasks.mapInArrow(task_fn, schema, barrier=barrier).collect()
        except BaseException as exc:
            self.error = exc
        finally:
            try:
                end_job_group(self.spark, self.job_id)
            except Exception as exc:  # the session may be gone after an interrupt
                logger.debug("could not clear the job tag %s: %s", self.job_id, exc)
            self.done = True
            self.service.notify()

    def start(self) -> None:
        """Submit the job (from a thread; the caller goes on to :meth:`wait`)."""
        self._thread.start()

    def wait(self, predicate: Callable[[StateT], bool], timeout: float | None) -> bool:
        """Wait until ``predicate(service state)`` holds or the job ended; False on timeout."""
        return self.service.wait(lambda state: self.done or predicate(state), timeout=timeout)

    def stop(self, reason: str | None, grace: float) -> None:
        """Abort the ranks with ``reason``; cancel the job unless it ends within ``grace`` s.

        Tasks kill their rank processes as soon as they see the abort, then return normally;
        cancelling the job group is the fallback (and the only way for tasks not yet started).
        ``reason`` None: the job is over on the driver's side, only wait for it to end.
        """
        if reason is not None:
            self.service.abort(reason)
        self.service.wait(lambda state: self.done, timeout=grace)
        if self.done:
            return
        try:
            cancel_job_group(self.spark, self.job_id)
        except Exception as exc:
            logger.warning("could not cancel Spark job group %s: %s", self.job_id, exc)
        self._thread.join(self.join_s)

    @contextlib.contextmanager
    def stopped_on_error(self) -> Iterator[None]:
        """Stop the job at once when the body raises (a timeout, Ctrl-C in a notebook)."""
        try:
            yield
        except RendezvousTimeoutError:
            self.stop("start_timeout expired", grace=0.0)
            raise
        except BaseException:
            self.stop("interrupted on the driver", grace=0.0)
            raise


__all__ = [
    "ADMISSION_WAIT_S",
    "EventCallback",
    "LaunchOptions",
    "NewJob",
    "SparkJob",
    "check_admission",
    "check_call",
    "new_job",
    "positive_int",
    "positive_seconds",
    "results_by_rank",
    "task_config",
]
