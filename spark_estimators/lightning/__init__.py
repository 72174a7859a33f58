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
    from spark_estimators.core.progress import plot_history as plot_history
    from spark_estimators.lightning.callbacks import TerminateOnNaN as TerminateOnNaN
    from spark_estimators.lightning.environment import (
        SparkClusterEnvironment as SparkClusterEnvironment,
    )
    from spark_estimators.lightning.estimator import MIN_PL_VERSION as MIN_PL_VERSION
    from spark_estimators.lightning.estimator import LightningEstimator as LightningEstimator
    from spark_estimators.lightning.model import LightningModel as LightningModel

    TorchEstimator = LightningEstimator
    TorchModel = LightningModel

#: The names that load on first use: name -> (module, attribute).
_LAZY = {
    "plot_history": ("spark_estimators.core.progress", "plot_history"),
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
}
__all__ = ["Backend", "SparkBackend", *_LAZY]
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)
