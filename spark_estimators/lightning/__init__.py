"""PyTorch Lightning estimator: ``LightningEstimator`` -> ``LightningModel``.

Needs the ``lightning`` extra. ``TorchEstimator`` / ``TorchModel`` are the names horovod's
``horovod.spark.lightning`` used; they are aliases here, so ``import spark_estimators.lightning as
hvd; hvd.TorchEstimator(...)`` runs horovod code unchanged. The names load lazily (rank
processes import only ``spark_estimators.lightning.remote``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_estimators import _lazy
from spark_estimators.core.backend import Backend, SparkBackend  # light: imported at once

_lazy.require(
    "spark_estimators.lightning", ("torch", "pytorch_lightning"), "spark-estimators[lightning]"
)

if TYPE_CHECKING:
    from spark_estimators.lightning.callbacks import TerminateOnNaN
    from spark_estimators.lightning.environment import SparkClusterEnvironment
    from spark_estimators.lightning.estimator import MIN_PL_VERSION, LightningEstimator
    from spark_estimators.lightning.model import LightningModel

    TorchEstimator = LightningEstimator
    TorchModel = LightningModel

__all__ = [
    "MIN_PL_VERSION",
    "Backend",
    "LightningEstimator",
    "LightningModel",
    "SparkBackend",
    "SparkClusterEnvironment",
    "TerminateOnNaN",
    "TorchEstimator",
    "TorchModel",
]

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "MIN_PL_VERSION": ("spark_estimators.lightning.estimator", "MIN_PL_VERSION"),
        "LightningEstimator": ("spark_estimators.lightning.estimator", "LightningEstimator"),
        "LightningModel": ("spark_estimators.lightning.model", "LightningModel"),
        "SparkClusterEnvironment": (
            "spark_estimators.lightning.environment",
            "SparkClusterEnvironment",
        ),
        "TerminateOnNaN": ("spark_estimators.lightning.callbacks", "TerminateOnNaN"),
        # horovod.spark.lightning's names
        "TorchEstimator": ("spark_estimators.lightning.estimator", "LightningEstimator"),
        "TorchModel": ("spark_estimators.lightning.model", "LightningModel"),
    },
)
