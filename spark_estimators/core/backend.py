"""Backends launch an estimator's training function on the ranks.

``SparkBackend`` (the default) runs it through :func:`spark_estimators.run` on Spark tasks;
``LocalBackend`` runs it as processes on this machine (one multi-GPU box, no cluster).
``backend=`` on an estimator accepts any :class:`Backend`, as horovod.spark's did.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, TypeVar, cast

from spark_estimators._base.session import get_spark
from spark_estimators.driver.launch_job import EventCallback, LaunchOptions, check_admission
from spark_estimators.errors import ConfigurationError
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


class LocalBackend(Backend):
    """Launch the ranks as processes on this machine: no Spark job, same estimator and store.

    For one multi-GPU box: ``TorchEstimator(..., backend=LocalBackend(num_proc=4))`` trains
    with 4 ranks here through the same code path as on a cluster (reader, collective,
    checkpoints, hot start, the Model). ``fit_on_parquet`` then needs no Spark at all (the
    store holds the Parquet; see docs/clusters.md, "One machine without Spark"); ``fit(df)``
    still prepares ``df`` with Spark. ``data="stream"`` needs Spark's tasks and is refused.

    GPUs: every rank sees this machine's GPUs (``gpus``, or all that torch finds, in this
    order, as ``CUDA_VISIBLE_DEVICES``) and takes the one of ``local_rank % len(gpus)``, so
    ranks share GPUs when there are more ranks than GPUs (Gloo allows that; NCCL does not, so
    ``collective_backend="auto"`` then takes Gloo, and ``"nccl"`` is refused with the fix).

    Parameters
    ----------
    num_proc
        Number of ranks (default 1).
    env
        Extra variables of the rank processes.
    collective_backend
        "auto" (NCCL with a GPU, else Gloo), "gloo", "nccl" or "mpi".
    use_gpu
        False hides the GPUs from the ranks; None or True gives them the GPUs.
    gpus
        The GPUs to use (CUDA ids as ``CUDA_VISIBLE_DEVICES`` takes them); default: the
        variable's value when it is set, else all that ``torch.cuda.device_count()`` counts.
    stdout, stderr
        Where the ranks' ``[rank]``-prefixed output goes (default the driver's).

    Examples
    --------
    >>> from spark_estimators import LocalBackend
    >>> from spark_estimators.torch import TorchEstimator
    >>> backend = LocalBackend(num_proc=2)
    >>> est = TorchEstimator(store=store, model=model, backend=backend)  # doctest: +SKIP
    >>> fitted = est.fit_on_parquet()  # doctest: +SKIP
    """

    def __init__(
        self,
        num_proc: int = 1,
        env: dict[str, str] | None = None,
        collective_backend: str = "auto",
        use_gpu: bool | None = None,
        gpus: list[str] | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ):
        # The same checks as a Spark job's (num_proc, env names, backend name).
        self.options = LaunchOptions(
            num_proc=num_proc, env=env, backend=collective_backend, stdout=stdout, stderr=stderr
        )
        self.use_gpu = use_gpu
        self.gpus = None if gpus is None else [str(g) for g in gpus]

    def num_processes(self) -> int:
        """``num_proc``."""
        return int(self.options.num_proc or 1)

    def visible_gpus(self) -> list[str]:
        """The GPUs the ranks see, in the order local ranks take them (``[]``: none)."""
        if self.use_gpu is False:
            return []
        if self.gpus is not None:
            return list(self.gpus)
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
        try:
            import torch
        except ImportError:
            return []
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [str(i) for i in range(count)]

    def run(
        self,
        fn: Callable[..., T],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        env: dict[str, str] | None = None,
        event_callback: EventCallback | None = None,
        stream_input: StreamSource | None = None,
    ) -> list[T]:
        """Run ``fn`` in ``num_proc`` local processes; one result per rank.

        Events the ranks send (epoch progress) have no driver service to reach here: the
        epoch lines are not printed, the history comes back with the results.
        """
        if stream_input is not None:
            raise ConfigurationError(
                "data='stream' reads the DataFrame in Spark tasks, which LocalBackend does not "
                "start: use data='parquet' (the default) or SparkBackend"
            )
        from spark_estimators.launch import run_local

        ranks_env = {**self.options.environment, **(env or {})}
        ranks_env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_gpus())
        results = run_local(
            fn,
            self.num_processes(),
            args,
            kwargs,
            env=ranks_env,
            backend=self.options.backend,
            stdout=self.options.stdout,
            stderr=self.options.stderr,
        )
        return cast("list[T]", results)
