"""Elastic fits (``elastic=True``): relaunch a failed training within the same ``fit``.

A failed attempt's :class:`~spark_estimators.errors.TrainingFailedError` is caught by the
estimator's training loop, which asks :class:`ElasticRelaunch` for the next attempt's backend
(the same ranks, or fewer when slots are missing) until ``reset_limit`` attempts failed; each
attempt resumes from the run's last checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spark_estimators.core import session
from spark_estimators.core.backend import Backend, SparkBackend
from spark_estimators.errors import ElasticResetLimitError, TrainingFailedError

logger = logging.getLogger(__name__)


class ElasticRelaunch:
    """The relaunch decisions of an estimator (uses its ``minNumProc`` and ``resetLimit``)."""

    if TYPE_CHECKING:  # provided by the estimator's Params

        def getMinNumProc(self) -> int | None: ...  # noqa: D102

        def getResetLimit(self) -> int: ...  # noqa: D102

    def _relaunch_backend(self, backend: Backend, exc: TrainingFailedError, reset: int) -> Backend:
        """The backend of the next attempt: the same ranks, or fewer when slots are missing.

        Barrier mode needs every rank's slot at once. On a cluster that lost an executor Spark
        may take a while to bring one back; a relaunch then goes on with the free slots when
        there are at least ``min_num_proc`` (the reader re-shards the same files by the new
        size, and the learning rate is re-scaled from the user's rate).
        """
        n = backend.num_processes()
        if isinstance(backend, SparkBackend):
            low = self.getMinNumProc() or n
            spark = session.get_spark(backend.spark)
            slots = session.available_task_slots(spark, needed=n, wait_s=30.0)
            if slots is not None and low <= slots < n:
                backend = backend.with_num_proc(slots)
        logger.warning(
            "elastic: training failed (%s); relaunching from the last checkpoint "
            "with %d ranks (reset %d of at most %d)",
            _summary(exc),
            backend.num_processes(),
            reset,
            self.getResetLimit(),
        )
        return backend

    def _reset_limit_error(self, failures: list[TrainingFailedError]) -> ElasticResetLimitError:
        lines = [f"attempt {i + 1}: {_summary(exc)}" for i, exc in enumerate(failures)]
        return ElasticResetLimitError(
            f"elastic fit stopped: reset_limit={self.getResetLimit()} reached after "
            f"{len(failures)} failed attempts ({'; '.join(lines)}). Fix the failure shown below "
            "(the last attempt's), or raise reset_limit; a refit with the same run_id resumes "
            "from the last checkpoint",
            failures[-1].worker_failures,
        )


def _summary(exc: TrainingFailedError) -> str:
    """One line per failure: which ranks and what they reported, without the tracebacks."""
    if exc.worker_failures:
        return ", ".join(
            f"rank {f.rank}: {f.message}" + (f" (exit code {f.exit_code})" if f.exit_code else "")
            for _, f in sorted(exc.worker_failures.items())
        )
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
