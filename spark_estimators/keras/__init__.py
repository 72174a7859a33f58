"""Keras estimator: ``KerasEstimator`` -> ``KerasModel``. Needs the ``keras`` extra.

Keras 3 with the TensorFlow backend. The names load lazily, so importing
``spark_estimators.keras.remote`` in a rank process can quiet TensorFlow before its first import.

>>> from spark_estimators.keras import KerasEstimator  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

for _name in ("keras", "tensorflow"):
    if importlib.util.find_spec(_name) is None:  # pragma: no cover - depends on the install
        raise ImportError(
            "spark_estimators.keras needs TensorFlow and Keras 3: "
            "pip install 'spark-estimators[keras]'"
        )

if TYPE_CHECKING:
    from spark_estimators.core.backend import Backend, SparkBackend
    from spark_estimators.keras.estimator import KerasEstimator
    from spark_estimators.keras.model import KerasModel

_EXPORTS = {
    "Backend": "spark_estimators.core.backend",
    "SparkBackend": "spark_estimators.core.backend",
    "KerasEstimator": "spark_estimators.keras.estimator",
    "KerasModel": "spark_estimators.keras.model",
}

__all__ = ["Backend", "KerasEstimator", "KerasModel", "SparkBackend"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spark_estimators.keras' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
