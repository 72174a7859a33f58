"""Backends launch an estimator's training function on the ranks.

``SparkBackend`` (the default) runs it through :func:`spark_estimators.run` on Spark tasks.
``backend=`` on an estimator accepts any :class:`Backend`, as horovod.spark's did.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, TypeVar

from spark_estimators._base.session import get_spark
from spark_estimators.driver.launch_job import EventCallback, LaunchOptions, check_admission
from spark_estimators.runner import StreamSource, launch

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")


class Backend(ABC):
    """Runs ``fn`` on ``num_processes()`` ranks and returns the per-rank results."""

    @abstractmethod
    def run(
        self,
        fn: Callable[..., T],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        env: dict[str, str] | None = None,
        event_callback: EventCallback | None = None,
    ) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results ordered by rank."""

    @abstractmethod
    def num_processes(self) -> int:
        """Number of ranks this backend starts."""

    def check_admission(self) -> None:  # noqa: B027 - optional hook, nothing to check by default
        """Raise ConfigurationError when the ranks cannot start (called before data is written)."""


class SparkBackend(Backend):
    """Launch on Spark tasks with :func:`spark_estimators.run` (barrier mode).

    The arguments are checked here, once, as a
    :class:`~spark_estimators.driver.launch_job.LaunchOptions` (:attr:`options`).

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
        spark: SparkSession | None = None,
    ):
        self.options = LaunchOptions(
            num_proc=num_proc,
            start_timeout=start_timeout,
            env=env,
            backend=collective_backend,
            verbose=verbose,
            use_gpu=use_gpu,
            stdout=stdout,
            stderr=stderr,
            prefix_output_with_timestamp=prefix_output_with_timestamp,
        )
        self.spark = spark

    @property
    def env(self) -> dict[str, str]:
        """The rank processes' extra variables (a dict; what is added to it is checked at run)."""
        return self.options.environment

    def with_num_proc(self, num_proc: int) -> SparkBackend:
        """A copy of this backend that starts ``num_proc`` ranks."""
        clone = copy.copy(self)
        clone.options = dataclasses.replace(self.options, num_proc=num_proc)
        return clone

    def num_processes(self) -> int:
        """``num_proc``, or the cluster's default (its task slots) when it was not given."""
        if self.options.num_proc is not None:
            return self.options.num_proc
        return self.options.sized(get_spark(self.spark)).ranks

    def check_admission(self) -> None:
        """Fail in the driver when the cluster has fewer task slots than ranks."""
        check_admission(
            get_spark(self.spark), self.num_processes(), wait_s=self.options.admission_wait_s
        )

    def run(
        self,
        fn: Callable[..., T],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        env: dict[str, str] | None = None,
        event_callback: EventCallback | None = None,
        stream_input: StreamSource | None = None,
    ) -> list[T]:
        """Run ``fn`` on the ranks with :func:`spark_estimators.run`; one result per rank.

        ``env`` is added to the backend's own; ``stream_input``: the estimators'
        ``data="stream"`` input (see :func:`~spark_estimators.run`).
        """
        return launch(
            dataclasses.replace(self.options, env={**self.env, **(env or {})}),
            fn,
            args,
            kwargs,
            spark=self.spark,
            event_callback=event_callback,
            stream_input=stream_input,
        )
