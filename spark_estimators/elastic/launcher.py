"""``run_elastic(fn, ...)``: a training function that survives failed and returning workers.

Design (see DECISIONS "Elastic" and docs/elastic.md): a barrier stage dies whole when one task
fails, so the job is an ordinary Spark job of ``max_num_proc`` tasks
(``sc.parallelize(range(n), n).mapPartitions(elastic_task)``). Each task attempt is a *worker*:
it joins the :class:`~spark_estimators.elastic.service.ElasticDriverService` and runs a rank
process whose ``fn`` is normally wrapped with ``hvd.elastic.run``. When a rank process dies,
its task raises so that Spark retries it; the survivors' next collective fails, they restore
their last ``state.commit()``, and every live worker meets at the next rendezvous round
(with the replacement when it arrives within ``rejoin_wait`` seconds, else without it; it joins
later through ``state.check_host_updates()``). Tasks Spark could not schedule at first join the
same way when slots free up, up to ``max_num_proc`` ranks.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, Any

import cloudpickle

from spark_estimators import envvars as ev
from spark_estimators._base.environ import validate_env
from spark_estimators._base.output import OutputPrinter
from spark_estimators._base.pickling import pickle_payload
from spark_estimators._base.session import (
    available_task_slots,
    cancel_job_group,
    default_num_proc,
    driver_service_host,
    end_job_group,
    ensure_driver_side,
    get_spark,
    spark_master,
    start_job_group,
)
from spark_estimators.driver.frames import new_secret
from spark_estimators.elastic.service import ElasticDriverService, ElasticPolicy, ElasticState
from spark_estimators.errors import (
    ConfigurationError,
    ElasticResetLimitError,
    RendezvousTimeoutError,
    TrainingFailedError,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

DEFAULT_ELASTIC_TIMEOUT = 600.0
DEFAULT_REJOIN_WAIT = 10.0
FINISH_GRACE_S = 10.0
TICK_S = 0.5


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    return value


def _policy(
    spark: SparkSession,
    num_proc: int | None,
    min_num_proc: int | None,
    max_num_proc: int | None,
    start_timeout: float | None,
    elastic_timeout: float | None,
    reset_limit: int | None,
    rejoin_wait: float,
) -> ElasticPolicy:
    if num_proc is None:
        num_proc = default_num_proc(spark)
    num = _positive_int("num_proc", num_proc)
    low = _positive_int("min_num_proc", num if min_num_proc is None else min_num_proc)
    high = _positive_int("max_num_proc", num if max_num_proc is None else max_num_proc)
    if not low <= num <= high:
        raise ConfigurationError(
            f"need min_num_proc <= num_proc <= max_num_proc, got {low} <= {num} <= {high}"
        )
    start = ev.start_timeout() if start_timeout is None else float(start_timeout)
    elastic = DEFAULT_ELASTIC_TIMEOUT if elastic_timeout is None else float(elastic_timeout)
    for name, value in (("start_timeout", start), ("elastic_timeout", elastic)):
        if value <= 0:
            raise ConfigurationError(f"{name} must be > 0 seconds, got {value!r}")
    if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
        raise ConfigurationError(f"reset_limit must be None or an int >= 0, got {reset_limit!r}")
    if rejoin_wait < 0:
        raise ConfigurationError(f"rejoin_wait must be >= 0 seconds, got {rejoin_wait!r}")
    slots = available_task_slots(spark, needed=num)
    if slots is not None and num > slots:
        raise ConfigurationError(
            f"num_proc={num} needs {num} concurrent Spark task slots to start, but the cluster "
            f"(master {spark_master(spark)!r}) has {slots}; lower num_proc (ranks beyond "
            "it can still join later up to max_num_proc)"
        )
    return ElasticPolicy(num, low, high, start, elastic, reset_limit, rejoin_wait)


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    *,
    backend: str = "gloo",
    use_gpu: bool | None = None,
    rejoin_wait: float = DEFAULT_REJOIN_WAIT,
    spark: SparkSession | None = None,
    event_callback: Callable[[int, str, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job; return the final ranks' results.

    ``fn`` usually builds a ``TorchState`` / ``ObjectState`` and calls a function decorated
    with ``hvd.elastic.run`` (see :mod:`spark_estimators.collective.api.elastic`).

    Parameters
    ----------
    fn, args, kwargs
        The function each worker runs, and its arguments (cloudpickle, inside the signed RPC).
    num_proc
        Ranks of the first round (default ``spark.default.parallelism``); that many task slots
        must exist.
    min_num_proc
        Fewest ranks to continue with after a failure (default ``num_proc``).
    max_num_proc
        Number of Spark tasks launched and most ranks of a round (default ``num_proc``).
    start_timeout
        Seconds for the first ``num_proc`` workers to meet (default 60, env
        ``SPARK_ESTIMATORS_START_TIMEOUT``).
    elastic_timeout
        Seconds a later rendezvous waits for at least ``min_num_proc`` workers (default 600).
    reset_limit
        Most resets (rounds after the first) before the job fails; None: no limit.
    env, stdout, stderr, verbose
        As for :func:`spark_estimators.run`; output lines are prefixed with the Spark
        partition index (a rank can change between rounds).
    backend
        Collective backend of the ranks (gloo; elastic resets re-create its group).
    use_gpu
        As for :func:`spark_estimators.run`.
    rejoin_wait
        Seconds a rendezvous waits for Spark's retry of a task that just failed before going
        on with fewer ranks (the retry joins later in any case).
    spark
        The SparkSession (default the active one). Spark must retry failed tasks:
        ``spark.task.maxFailures`` > 1, or master ``local[N,F]`` in local mode.
    event_callback
        ``callback(index, kind, data)`` for events sent with ``spark_estimators.task.send_event``.

    Returns
    -------
    list
        ``fn``'s return values from the ranks of the last round, by rank.

    Raises
    ------
    ConfigurationError
        Bad arguments, checked before any job starts.
    RendezvousTimeoutError
        The first ``num_proc`` workers did not meet within ``start_timeout``.
    ElasticResetLimitError
        More than ``reset_limit`` resets.
    TrainingFailedError
        Fewer than ``min_num_proc`` workers for ``elastic_timeout``, Spark gave up retrying a
        task, or a rank failed after others had finished; lists every worker failure seen.
    """
    ensure_driver_side("run_elastic")
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {type(fn).__name__}")
    extra_env = validate_env(env)
    spark = get_spark(spark)
    policy = _policy(
        spark, num_proc, min_num_proc, max_num_proc, start_timeout, elastic_timeout,
        reset_limit, float(rejoin_wait),
    )  # fmt: skip
    from spark_estimators.task.spark_task import TaskConfig

    payload = pickle_payload(fn, tuple(args), dict(kwargs or {}))
    job_id = "spark_estimators-elastic-" + uuid.uuid4().hex[:12]
    secret = new_secret()
    host = driver_service_host(spark)
    svc = ElasticDriverService(
        policy,
        secret,
        payload,
        env=extra_env,
        host=host,
        output=OutputPrinter(stdout, stderr, False),
        events=event_callback,
    )
    config = TaskConfig(
        driver_address=svc.address,
        secret=secret,
        job_id=job_id,
        start_timeout=policy.start_timeout,
        backend=backend,
        use_gpu=use_gpu,
    )
    if verbose >= 1:
        logger.info(
            "elastic job %s: %d ranks (min %d, max %d)",
            job_id,
            policy.num_proc,
            policy.min_num_proc,
            policy.max_num_proc,
        )
    try:
        return _Supervisor(spark, svc, config, policy).run()
    finally:
        svc.close()


class _Supervisor:
    def __init__(
        self, spark: SparkSession, svc: ElasticDriverService, config: Any, policy: ElasticPolicy
    ):
        self.spark, self.svc, self.config, self.policy = spark, svc, config, policy
        self.box: dict[str, Any] = {"done": False}

    def _job(self) -> None:
        from spark_estimators.elastic.task import elastic_task

        n = self.policy.max_num_proc
        job_id = self.config.job_id
        try:
            start_job_group(self.spark, job_id, f"spark_estimators.run_elastic {n} tasks")
            # Not a barrier stage: a failed task is retried by Spark and joins the next round.
            df = self.spark.range(n, numPartitions=n)
            out = df.mapInArrow(partial(elastic_task, self.config), "worker string")
            self.box["rows"] = out.collect()
        except BaseException as exc:
            self.box["error"] = exc
        finally:
            try:
                end_job_group(self.spark, job_id)
            except Exception as exc:  # the session may be gone after an interrupt
                logger.debug("could not clear the job tag %s: %s", job_id, exc)
            self.box["done"] = True
            self.svc.notify()

    def run(self) -> list[Any]:
        thread = threading.Thread(target=self._job, name="se-elastic-job", daemon=True)
        thread.start()

        def over(s: ElasticState) -> bool:
            return s.done or s.abort_reason is not None or self.box["done"]

        try:
            while not self.svc.wait(over, timeout=TICK_S):
                self.svc.tick()
        except BaseException:
            self.svc.abort("interrupted on the driver")
            self._cancel(thread)
            raise
        state = self.svc.state
        if state.done:
            # Workers still waiting are told the job is over; Spark's job then ends by itself.
            self.svc.wait(lambda s: self.box["done"], timeout=FINISH_GRACE_S)
            if not self.box["done"]:
                self._cancel(thread)
            return [cloudpickle.loads(state.results[r]) for r in range(len(state.members))]
        self.svc.abort(state.abort_reason or "the Spark job ended")
        self._cancel(thread)
        raise self._error()

    def _cancel(self, thread: threading.Thread) -> None:
        try:
            cancel_job_group(self.spark, self.config.job_id)
        except Exception as exc:
            logger.warning("could not cancel Spark job group %s: %s", self.config.job_id, exc)
        thread.join(FINISH_GRACE_S)

    def _error(self) -> Exception:
        state = self.svc.state
        failures = {i: f for i, f in enumerate(state.failures)}
        summary = f"after {state.resets} reset(s), {len(state.failures)} worker failure(s)"
        if state.abort_error == "reset_limit":
            return ElasticResetLimitError(
                f"the elastic job stopped: {state.abort_reason} ({summary})", failures
            )
        if state.abort_error == "start_timeout":
            return RendezvousTimeoutError(
                f"the elastic job could not start: {state.abort_reason}; raise start_timeout "
                f"or lower num_proc",
                expected=self.policy.num_proc,
            )
        reason = state.abort_reason
        if reason is None or reason == "the Spark job ended":
            error = self.box.get("error")
            reason = f"the Spark job ended ({error})" if error else "the Spark job ended"
        return TrainingFailedError(f"the elastic job failed: {reason} ({summary})", failures)
