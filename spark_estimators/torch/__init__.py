"""PyTorch estimator: ``TorchEstimator`` -> ``TorchModel``. Needs the ``torch`` extra."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "spark_estimators.torch needs PyTorch: pip install 'spark-estimators[torch]'"
    ) from exc

from spark_estimators.core.backend import Backend, SparkBackend
from spark_estimators.torch.callbacks import EarlyStopping
from spark_estimators.torch.estimator import TorchEstimator
from spark_estimators.torch.model import TorchModel

__all__ = ["Backend", "EarlyStopping", "SparkBackend", "TorchEstimator", "TorchModel"]
