"""Elastic training on Spark: ``run_elastic`` keeps a job going when workers fail or return.

The driver side lives here (launcher, driver service, Spark task, rank process entry point);
the training-side API is ``spark_estimators.collective.api.elastic`` (``State``, ``ObjectState``,
``run``) and ``spark_estimators.collective.torch.elastic`` (``TorchState``).
:func:`spark_estimators.run_elastic` is :func:`run_elastic` here.
"""

from __future__ import annotations

from typing import Any

from spark_estimators import run_options


def run_elastic(*args: Any, **kwargs: Any) -> list[Any]:
    """Fault-tolerant :func:`spark_estimators.run`.

    See :func:`spark_estimators.elastic.launcher.run_elastic` for the arguments.

    Also takes Horovod's names ``min_np`` / ``max_np`` / ``np``, ``nics`` and ``timeline`` (see
    :mod:`spark_estimators.run_options`).
    """
    from spark_estimators.elastic.launcher import run_elastic as _run_elastic

    args, kwargs = run_options.elastic_arguments(args, kwargs)  # Horovod's names (min_np, ...)
    return list(_run_elastic(*args, **kwargs))


__all__ = ["run_elastic"]
