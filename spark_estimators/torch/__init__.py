"""PyTorch estimator: ``TorchEstimator`` -> ``TorchModel``. Needs the ``torch`` extra.

The names load lazily: a rank process importing ``spark_estimators.torch.remote`` does not pay
for the driver-side estimator (``pyspark.ml``, pandas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_estimators import _lazy
from spark_estimators.core.backend import Backend, SparkBackend  # light: imported at once

_lazy.require("spark_estimators.torch", ("torch",), "spark-estimators[torch]")

if TYPE_CHECKING:
    from spark_estimators.torch.callbacks import EarlyStopping, LearningRateScheduler
    from spark_estimators.torch.estimator import TorchEstimator
    from spark_estimators.torch.model import TorchModel

__all__ = [
    "Backend",
    "EarlyStopping",
    "LearningRateScheduler",
    "SparkBackend",
    "TorchEstimator",
    "TorchModel",
]

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "EarlyStopping": ("spark_estimators.torch.callbacks", "EarlyStopping"),
        "LearningRateScheduler": ("spark_estimators.torch.callbacks", "LearningRateScheduler"),
        "TorchEstimator": ("spark_estimators.torch.estimator", "TorchEstimator"),
        "TorchModel": ("spark_estimators.torch.model", "TorchModel"),
    },
)
