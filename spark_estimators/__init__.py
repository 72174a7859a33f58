"""spark_estimators: distributed deep learning on Spark, as easy as ``estimator.fit(df)``."""

from __future__ import annotations

from spark_estimators.errors import (
    CollectiveError,
    ConfigurationError,
    RendezvousTimeoutError,
    SparkEstimatorsError,
    StoreError,
    TrainingFailedError,
)
from spark_estimators.runner import run

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ConfigurationError",
    "RendezvousTimeoutError",
    "SparkEstimatorsError",
    "StoreError",
    "TrainingFailedError",
    "__version__",
    "run",
]
