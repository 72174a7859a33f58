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
    from spark_estimators.core.progress import plot_history as plot_history
    from spark_estimators.torch.callbacks import EarlyStopping as EarlyStopping
    from spark_estimators.torch.callbacks import LearningRateScheduler as LearningRateScheduler
    from spark_estimators.torch.estimator import TorchEstimator as TorchEstimator
    from spark_estimators.torch.model import TorchModel as TorchModel

#: The names that load on first use: name -> (module, attribute).
_LAZY = {
    "plot_history": ("spark_estimators.core.progress", "plot_history"),
    "EarlyStopping": ("spark_estimators.torch.callbacks", "EarlyStopping"),
    "LearningRateScheduler": ("spark_estimators.torch.callbacks", "LearningRateScheduler"),
    "TorchEstimator": ("spark_estimators.torch.estimator", "TorchEstimator"),
    "TorchModel": ("spark_estimators.torch.model", "TorchModel"),
}
__all__ = ["Backend", "SparkBackend", *_LAZY]
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)
