"""Elastic training on Spark: ``run_elastic`` keeps a job going when workers fail or return.

The driver side lives here (launcher, driver service, Spark task, rank process entry point);
the training-side API is ``spark_estimators.collective.elastic`` (``State``, ``ObjectState``,
``run``) and ``spark_estimators.collective.torch.elastic`` (``TorchState``).
"""

# runner's wrapper: the launcher's run_elastic plus Horovod's argument names (min_np, nics, ...).
from spark_estimators.runner import run_elastic

__all__ = ["run_elastic"]
