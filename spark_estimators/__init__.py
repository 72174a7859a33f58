"""spark_estimators: distributed deep learning on Spark, as easy as ``estimator.fit(df)``."""

from __future__ import annotations

from spark_estimators.core.backend import Backend, LocalBackend, SparkBackend
from spark_estimators.elastic import run_elastic
from spark_estimators.errors import (
    CollectiveError,
    ConfigurationError,
    RendezvousTimeoutError,
    RunInUseError,
    SparkEstimatorsError,
    StoreError,
    TrainingFailedError,
)
from spark_estimators.runner import run
from spark_estimators.store import Store

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "LocalBackend",
    "CollectiveError",
    "ConfigurationError",
    "RendezvousTimeoutError",
    "RunInUseError",
    "SparkBackend",
    "SparkEstimatorsError",
    "Store",
    "StoreError",
    "TrainingFailedError",
    "__version__",
    "run",
    "run_elastic",
]
