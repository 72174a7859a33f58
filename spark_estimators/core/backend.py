"""Backends launch an estimator's training function on the ranks.

``SparkBackend`` (the default) runs it through :func:`spark_estimators.run` on Spark tasks.
``backend=`` on an estimator accepts any :class:`Backend`, as horovod.spark's did.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import IO, Any

from spark_estimators.errors import ConfigurationError


class Backend(ABC):
    """Runs ``fn`` on ``num_processes()`` ranks and returns the per-rank results."""

    @abstractmethod
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        event_callback: Callable[[int, str, Any], None] | None = None,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results ordered by rank."""

    @abstractmethod
    def num_processes(self) -> int:
        """Number of ranks this backend starts."""

    def check_admission(self) -> None:  # noqa: B027 - optional hook, nothing to check by default
        """Raise ConfigurationError when the ranks cannot start (called before data is written)."""


class SparkBackend(Backend):
    """Launch on Spark tasks with :func:`spark_estimators.run` (barrier mode).

    Parameters
    ----------
    num_proc
        Number of ranks; default ``spark.default.parallelism``.
    env, stdout, stderr, verbose, start_timeout, use_gpu, prefix_output_with_timestamp
        As in :func:`spark_estimators.run`.
    collective_backend
        "auto", "gloo", "nccl" or "mpi".
    spark
        The SparkSession (default: the active one).
    """

    def __init__(
        self,
        num_proc: int | None = None,
        env: dict[str, str] | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        verbose: int = 1,
        start_timeout: float | None = None,
        use_gpu: bool | None = None,
        collective_backend: str = "auto",
        prefix_output_with_timestamp: bool = False,
        spark: Any = None,
    ):
        if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
            raise ConfigurationError(f"num_proc must be a positive int, got {num_proc!r}")
        self._num_proc = num_proc
        self.env = dict(env or {})
        self.stdout, self.stderr = stdout, stderr
        self.verbose = verbose
        self.start_timeout = start_timeout
        self.use_gpu = use_gpu
        self.collective_backend = collective_backend
        self.prefix_output_with_timestamp = prefix_output_with_timestamp
        self.spark = spark

    def with_num_proc(self, num_proc: int) -> SparkBackend:
        """A copy of this backend that starts ``num_proc`` ranks."""
        clone = copy.copy(self)
        clone._num_proc = num_proc
        return clone

    def num_processes(self) -> int:
        """``num_proc``, or the cluster's default (its task slots) when it was not given."""
        if self._num_proc is None:
            from spark_estimators.core.session import default_num_proc, get_spark

            return default_num_proc(get_spark(self.spark))
        return self._num_proc

    def check_admission(self) -> None:
        """Fail in the driver when the cluster has fewer task slots than ranks."""
        from spark_estimators.core.session import get_spark
        from spark_estimators.runner import ADMISSION_WAIT_S, check_admission

        timeout = self.start_timeout if self.start_timeout is not None else ADMISSION_WAIT_S
        check_admission(
            get_spark(self.spark), self.num_processes(), wait_s=min(timeout, ADMISSION_WAIT_S)
        )

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        event_callback: Callable[[int, str, Any], None] | None = None,
        stream_input: Any = None,
    ) -> list[Any]:
        """Run ``fn`` on the ranks with :func:`spark_estimators.run`; one result per rank.

        ``stream_input``: the estimators' ``data="stream"`` input (see
        :func:`~spark_estimators.run`).
        """
        from spark_estimators.runner import run

        merged = dict(self.env)
        merged.update(env or {})
        return run(
            fn,
            args=args,
            kwargs=kwargs,
            num_proc=self.num_processes(),
            start_timeout=self.start_timeout,
            env=merged,
            stdout=self.stdout,
            stderr=self.stderr,
            verbose=self.verbose,
            use_gpu=self.use_gpu,
            prefix_output_with_timestamp=self.prefix_output_with_timestamp,
            backend=self.collective_backend,
            spark=self.spark,
            event_callback=event_callback,
            stream_input=stream_input,
        )
