"""KerasModel: the Transformer a KerasEstimator returns.

``transform`` is the shared batched mechanism of :class:`~spark_estimators.core.model.SparkModel`
(Arrow batches through ``mapInArrow``, the model loaded once per Python worker); each batch of
``transformBatchSize`` rows goes through ``model.predict_on_batch``. The model travels as
``.keras`` bytes plus the ``custom_objects`` (pickled by value, so classes defined in a notebook
or test file load on executors too): the user's own and those the estimator found
(:func:`~spark_estimators.keras.serialization.find_custom_objects`).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import cloudpickle

from spark_estimators.core.model import Predictor, SparkModel

if TYPE_CHECKING:
    import keras
    import numpy as np
    from pyspark.sql import DataFrame

logger = logging.getLogger(__name__)


def dumps_custom_objects(custom_objects: Mapping[str, object] | None) -> bytes:
    """Pickle ``custom_objects``; classes from the user's own modules go by value."""
    from spark_estimators._base.pickling import dumps_by_value

    objects = dict(custom_objects or {})
    return dumps_by_value(objects, roots=list(objects.values()))


def load_keras_model(data: bytes, custom_objects: Mapping[str, object] | None) -> keras.Model:
    """``.keras`` bytes -> a Keras model, compiled when its loss and metrics can be loaded.

    Keras finds a custom loss/metric when it is registered or in ``custom_objects`` (the
    estimator adds the ones passed as ``loss``/``metrics``); when one cannot be found or
    rebuilt, the model is loaded uncompiled (``predict`` works) with a warning
    (:func:`warn_uncompiled`).
    """
    import keras

    from spark_estimators.keras.remote import model_from_bytes

    with keras.saving.custom_object_scope(custom_objects or {}):
        try:
            return model_from_bytes(data, custom_objects, compile=True)
        except (TypeError, ValueError) as exc:
            warn_uncompiled(f"{type(exc).__name__}: {exc}")
            return model_from_bytes(data, custom_objects, compile=False)


def warn_uncompiled(reason: str) -> None:
    """The warning for a trained model that comes back without its compile state."""
    if len(reason) > 400:
        reason = reason[:400] + "..."
    logger.warning(
        "the trained model is returned without its compile state (%s): a custom loss or metric "
        "must be a function or a class with get_config() (not a functools.partial or a plain "
        "callable object) that Keras can find: registered with "
        "keras.saving.register_keras_serializable, passed as loss=/metrics=, or in "
        "custom_objects. predict() works; compile() the model again to evaluate or train it",
        reason,
    )


def flat_outputs(out: object) -> list[object]:
    """A prediction (one array, a list, or a dict of named outputs) as a list of arrays.

    Keras's own order (``keras.tree.flatten``: a dict's keys sorted, which is also the order of
    ``model.output_names`` and the one a tuple of labels is matched to), so output ``i`` is
    ``label_cols[i]``'s and goes to ``outputCols[i]``.
    """
    import keras

    return list(keras.tree.flatten(out))


class KerasPredictor(Predictor):
    """Loads the Keras model once per Python worker and predicts numpy batches."""

    def load(self, blob: bytes) -> keras.Model:
        """The Keras model from its bytes, with its custom objects."""
        if "tensorflow" not in sys.modules:
            # An executor's Python worker: quiet TensorFlow before its first import.
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        state = pickle.loads(blob)
        custom = cloudpickle.loads(state["custom_objects"]) or {}
        return load_keras_model(state["keras"], custom)

    def predict(self, model: keras.Model, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run the model on one batch of input arrays and return one array per output."""
        import numpy as np

        out = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
        return [np.asarray(o, dtype=np.float64) for o in flat_outputs(out)]


class KerasModel(SparkModel):
    """A trained Keras model as a Spark ML Transformer.

    ``transform(df)`` appends one column per model output (``<label>__output`` by default,
    ``setOutputCols`` renames); ``getModel()`` returns the ``keras.Model`` (compiled with the
    plain optimizer when its loss and metrics can be loaded); ``getHistory()`` the per-epoch
    metrics averaged over the ranks (``epoch``, ``loss``, metrics, ``val_*``);
    ``write().save(path)`` / ``KerasModel.load(path)`` and Pipeline persistence work as for any
    Spark ML model. Loading unpickles ``custom_objects`` and reads the ``.keras`` archive with
    ``safe_mode=False``, so it is verified first, as for ``TorchModel`` (docs/security.md).
    """

    def __init__(
        self,
        *,
        custom_objects: Mapping[str, object] | None = None,
        vector_outputs: list[bool] | None = None,
        **kwargs: Any,
    ) -> None:
        """``custom_objects`` to load the model with; the other keywords as for SparkModel.

        ``vector_outputs[i]``: output ``i``'s label was an ML vector column, so ``transform``
        writes that output as a ``VectorUDT`` column, as horovod did
        (:mod:`spark_estimators.keras.outputs`).
        """
        super().__init__(**kwargs)
        self._custom_objects = dict(custom_objects or {})
        self._vector_outputs = [bool(v) for v in (vector_outputs or [])]
        self._rank_fingerprints: list[str] = []

    def getCustomObjects(self) -> dict[str, object]:
        """The ``custom_objects`` the model is loaded with."""
        return dict(self._custom_objects)

    def _model_to_bytes(self) -> bytes:
        from spark_estimators.keras.remote import model_to_bytes

        return pickle.dumps(
            {
                "keras": model_to_bytes(self._model),
                "custom_objects": dumps_custom_objects(self._custom_objects),
            }
        )

    def _model_from_bytes(self, blob: bytes) -> keras.Model:
        state = pickle.loads(blob)
        self._custom_objects = cloudpickle.loads(state["custom_objects"]) or {}
        return load_keras_model(state["keras"], self._custom_objects)

    def _predictor(self) -> Predictor:
        return KerasPredictor()

    def _extra_state(self) -> dict[str, object]:
        return {**super()._extra_state(), "vector_outputs": self._vector_outputs}

    def _restore_extra_state(self, state: dict[str, object]) -> None:
        super()._restore_extra_state(state)
        # Models saved before vector outputs existed wrote arrays: keep doing so.
        self._vector_outputs = list(cast("list[bool]", state.get("vector_outputs") or []))

    def _transform(self, df: DataFrame) -> DataFrame:
        from spark_estimators.keras.outputs import with_vector_outputs

        scored = super()._transform(df)
        return with_vector_outputs(
            scored, self.output_cols(), self._output_shapes, self._vector_outputs
        )
