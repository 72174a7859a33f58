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
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, TypeVar, cast

from spark_estimators._base.session import driver_service_host, ensure_driver_side, get_spark
from spark_estimators.driver import launch_job
from spark_estimators.elastic.service import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_REJOIN_WAIT,
    ElasticDriverService,
    ElasticPolicy,
    ElasticState,
)
from spark_estimators.elastic.task import elastic_task
from spark_estimators.errors import (
    ElasticResetLimitError,
    RendezvousTimeoutError,
    TrainingFailedError,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

T = TypeVar("T")

FINISH_GRACE_S = 10.0
TICK_S = 0.5

__all__ = ["DEFAULT_ELASTIC_TIMEOUT", "DEFAULT_REJOIN_WAIT", "run_elastic"]


def run_elastic(
    fn: Callable[..., T],
    args: Sequence[object] = (),
    kwargs: dict[str, object] | None = None,
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
    event_callback: launch_job.EventCallback | None = None,
) -> list[T]:
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
        Seconds a later rendezvous waits for at least ``min_num_proc`` workers (default 600);
        while ranks of the last round are still alive (in a collective whose peers left),
        it waits for them at least the ranks' collective timeout + 10 s.
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
    launch_job.check_call(fn, args, kwargs)
    options = launch_job.LaunchOptions(
        num_proc=num_proc,
        start_timeout=start_timeout,
        env=env,
        backend=backend,
        verbose=verbose,
        use_gpu=use_gpu,
        stdout=stdout,
        stderr=stderr,
    )
    spark = get_spark(spark)
    options = options.sized(spark)
    policy = ElasticPolicy.of(
        options.ranks, min_num_proc, max_num_proc, options.timeout, elastic_timeout,
        reset_limit, rejoin_wait,
    )  # fmt: skip
    launch_job.check_admission(
        spark, policy.num_proc,
        hint="; lower num_proc (ranks beyond it can still join later up to max_num_proc)",
    )  # fmt: skip
    job = launch_job.new_job("spark_estimators-elastic", fn, args, kwargs)
    svc = ElasticDriverService(
        policy,
        job.secret,
        job.payload,
        env=options.environment,
        host=driver_service_host(spark),
        output=options.output(),
        events=event_callback,
    )
    config = launch_job.task_config(job, svc, options)
    n = policy.max_num_proc
    # Not a barrier stage: a failed task is retried by Spark and joins the next round.
    spark_job = launch_job.SparkJob(
        spark, svc, job.job_id, f"spark_estimators.run_elastic {n} tasks",
        spark.range(n, numPartitions=n), partial(elastic_task, config), "worker string",
        barrier=False, join_s=FINISH_GRACE_S,
    )  # fmt: skip
    if verbose >= 1:
        logger.info(
            "elastic job %s: %d ranks (min %d, max %d)",
            job.job_id,
            policy.num_proc,
            policy.min_num_proc,
            policy.max_num_proc,
        )
    try:
        return cast("list[T]", _supervise(spark_job, svc))  # what the ranks' fn returned
    finally:
        svc.close()


def _supervise(job: launch_job.SparkJob[ElasticState], svc: ElasticDriverService) -> list[object]:
    """Re-check the service's timeouts until the job is done, failed or interrupted."""

    def over(s: ElasticState) -> bool:
        return s.done or s.abort_reason is not None

    job.start()
    with job.stopped_on_error():
        while not job.wait(over, timeout=TICK_S):
            svc.tick()
    state = svc.state
    if state.done:
        # Workers still waiting are told the job is over; Spark's job then ends by itself.
        job.stop(None, grace=FINISH_GRACE_S)
        return launch_job.results_by_rank(state.results, len(state.members))
    job.stop(state.abort_reason or "the Spark job ended", grace=0.0)
    raise _error(svc, job.error)


def _error(svc: ElasticDriverService, job_error: BaseException | None) -> Exception:
    state = svc.state
    failures = dict(enumerate(state.failures))
    summary = f"after {state.resets} reset(s), {len(state.failures)} worker failure(s)"
    if state.abort_error == "reset_limit":
        return ElasticResetLimitError(
            f"the elastic job stopped: {state.abort_reason} ({summary})", failures
        )
    if state.abort_error == "start_timeout":
        return RendezvousTimeoutError(
            f"the elastic job could not start: {state.abort_reason}; raise start_timeout "
            f"or lower num_proc",
            expected=svc.policy.num_proc,
        )
    reason = state.abort_reason
    if (reason is None or reason == "the Spark job ended") and failures:
        # The ranks' own errors say why; the Spark error (the task that failed once too often,
        # with the executors' traces) would only bury them, so it is left out, not chained.
        reason = (
            "Spark stopped retrying a failed task (spark.task.maxFailures, or F in a local[N,F] "
            "master, attempts used up)"
        )
    elif reason is None or reason == "the Spark job ended":
        reason = f"the Spark job ended ({job_error})" if job_error else "the Spark job ended"
    return TrainingFailedError(f"the elastic job failed: {reason} ({summary})", failures)
