"""PyTorch Lightning estimator: ``LightningEstimator`` -> ``LightningModel``.

Needs the ``lightning`` extra. ``TorchEstimator`` / ``TorchModel`` are the names horovod's
``horovod.spark.lightning`` used; they are aliases here, so ``import spark_estimators.lightning as
hvd; hvd.TorchEstimator(...)`` runs horovod code unchanged.
"""

try:
    import pytorch_lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "spark_estimators.lightning needs PyTorch Lightning: pip install "
        "'spark-estimators[lightning]'"
    ) from exc

from spark_estimators.core.backend import Backend, SparkBackend
from spark_estimators.lightning.callbacks import TerminateOnNaN
from spark_estimators.lightning.environment import SparkClusterEnvironment
from spark_estimators.lightning.estimator import MIN_PL_VERSION, LightningEstimator
from spark_estimators.lightning.model import LightningModel

#: horovod.spark.lightning's names.
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
