"""Elastic training on Spark: ``run_elastic`` keeps a job going when workers fail or return.

The driver side lives here (launcher, driver service, Spark task, rank process entry point);
the training-side API is ``spark_estimators.collective.elastic`` (``State``, ``ObjectState``,
``run``) and ``spark_estimators.collective.torch_elastic`` (``TorchState``).
"""

from spark_estimators.elastic.launcher import run_elastic

__all__ = ["run_elastic"]
