"""Keras estimator: ``KerasEstimator`` -> ``KerasModel``. Needs the ``keras`` extra.

Keras 3 with the TensorFlow backend. The names load lazily, so importing
``spark_estimators.keras.remote`` in a rank process can quiet TensorFlow before its first import.

>>> from spark_estimators.keras import KerasEstimator  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_estimators import _lazy
from spark_estimators.core.backend import Backend, SparkBackend  # light: imported at once

_lazy.require("spark_estimators.keras", ("keras", "tensorflow"), "spark-estimators[keras]")

if TYPE_CHECKING:
    from spark_estimators.core.progress import plot_history as plot_history
    from spark_estimators.keras.estimator import KerasEstimator as KerasEstimator
    from spark_estimators.keras.model import KerasModel as KerasModel

#: The names that load on first use: name -> (module, attribute).
_LAZY = {
    "plot_history": ("spark_estimators.core.progress", "plot_history"),
    "KerasEstimator": ("spark_estimators.keras.estimator", "KerasEstimator"),
    "KerasModel": ("spark_estimators.keras.model", "KerasModel"),
}
__all__ = ["Backend", "SparkBackend", *_LAZY]
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)
