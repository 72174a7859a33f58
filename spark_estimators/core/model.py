"""The Model (Transformer) base: batched inference with Arrow, persistence, history.

``transform(df)`` converts ML vector feature columns with ``vector_to_array`` (a SQL expression,
no Python row mapping) and scores Arrow batches with a scalar-iterator ``arrow_udf`` (Spark >= 4.1:
only the feature columns travel to Python and back comes one struct of outputs) or, on older
Spark and for a streaming DataFrame with a vector column, ``mapInArrow`` over whole rows. Each
Python worker loads the model **once** (cached by model key across the tasks it serves) and
predicts ``transformBatchSize`` rows at a time, on the task's GPU when there is one. Output
columns are ``<label>__output`` by default (``setOutputCols`` renames); array outputs keep their
shape.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, cast

from pyspark.ml import Model
from pyspark.ml.param.shared import HasOutputCols

from spark_estimators.core import tensors
from spark_estimators.core.history import History
from spark_estimators.core.params.shared import (
    HasFeatureCols,
    HasInputShapes,
    HasLabelCols,
    HasTransformBatchSize,
)
from spark_estimators.core.persistence import PersistenceMixin
from spark_estimators.errors import ConfigurationError, did_you_mean

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame

_CACHE: dict[str, object] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_MAX = 4


class PredictSpec(TypedDict):
    """What ``transform`` ships to the Python workers that score the batches."""

    predictor: Predictor
    key: str
    blob: object
    inputs: dict[str, int]
    feature_cols: list[str]
    input_shapes: list[list[int] | None] | None
    output_cols: list[str]
    output_shapes: list[tuple[int, ...]]
    batch_size: int
    keep: list[int]


class Predictor:
    """Framework side of inference; picklable, shipped to executors by ``transform``.

    Subclasses implement :meth:`load` (bytes -> ready model) and :meth:`predict`.
    """

    def load(self, blob: bytes) -> object:
        """The framework model from the bytes the estimator stored."""
        raise NotImplementedError

    def predict(self, model: object, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Model outputs as numpy arrays, one per output column."""
        raise NotImplementedError


def _cached_model(key: str, predictor: Predictor, blob_source: object) -> object:
    with _CACHE_LOCK:
        model = _CACHE.get(key)
        if model is None:
            blob = blob_source.value if hasattr(blob_source, "value") else blob_source
            model = predictor.load(cast(bytes, blob))
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = model
        return model


def predict_batches(
    spec: PredictSpec, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: append the model's outputs to every Arrow batch."""
    import pyarrow as pa

    predictor: Predictor = spec["predictor"]
    model = _cached_model(spec["key"], predictor, spec["blob"])
    keep = spec["keep"]
    for batch in batches:
        arrays = {c: tensors.arrow_to_numpy(batch.column(t), c) for c, t in spec["inputs"].items()}
        columns = [batch.column(i) for i in keep]
        columns += _predict_columns(spec, arrays, batch.num_rows, predictor, model)
        names = [batch.schema.field(i).name for i in keep] + list(spec["output_cols"])
        yield pa.RecordBatch.from_arrays(columns, names=names)


def _predict_columns(
    spec: PredictSpec,
    arrays: dict[str, np.ndarray],
    n: int,
    predictor: Predictor,
    model: object,
) -> list[pa.Array]:
    """The output columns for ``n`` rows of feature ``arrays``, ``batch_size`` rows at a time."""
    import numpy as np

    outs: list[list[np.ndarray]] = [[] for _ in spec["output_cols"]]
    step = spec["batch_size"]
    for start in range(0, n, step):
        part = {c: a[start : start + step] for c, a in arrays.items()}
        inputs = tensors.model_inputs(part, spec["feature_cols"], spec["input_shapes"])
        for i, out in enumerate(predictor.predict(model, inputs)):
            outs[i].append(out)
    columns = []
    for i in range(len(spec["output_cols"])):
        shape = spec["output_shapes"][i]
        values = np.concatenate(outs[i]).reshape((n, *shape)) if n else np.zeros((0, *shape))
        columns.append(tensors.numpy_to_arrow(values))
    return columns


def _predict_arrays(
    spec: PredictSpec, arrays: list[pa.Array], predictor: Predictor, model: object
) -> pa.StructArray:
    """Predict one chunk of Arrow feature arrays; returns a struct array of the outputs."""
    import pyarrow as pa

    features = spec["feature_cols"]
    cols = {c: tensors.arrow_to_numpy(a, c) for c, a in zip(features, arrays, strict=True)}
    fields = _predict_columns(spec, cols, len(arrays[0]), predictor, model)
    return pa.StructArray.from_arrays(fields, names=list(spec["output_cols"]))


def predict_udf(
    spec: PredictSpec, batches: Iterator[pa.Array | tuple[pa.Array, ...]]
) -> Iterator[pa.StructArray]:
    """Scalar-iterator Arrow UDF body: the model loads once per task, only features travel."""
    predictor: Predictor = spec["predictor"]
    model = _cached_model(spec["key"], predictor, spec["blob"])
    for batch in batches:
        arrays = list(batch) if isinstance(batch, tuple | list) else [batch]
        yield _predict_arrays(spec, arrays, predictor, model)


class ModelParams(
    HasFeatureCols, HasLabelCols, HasInputShapes, HasTransformBatchSize, HasOutputCols
):
    """The params every model shares: columns, input shapes, output columns, batch size.

    The same mixins as the estimators' (:mod:`spark_estimators.core.params.shared`), so a model
    copies its estimator's values under the same names.
    """

    _defaults: ClassVar[dict[str, object]] = {"outputCols": []}

    # horovod's HorovodModel names
    def getFeatureColumns(self) -> list[str]:
        """Horovod's spelling of :meth:`getFeatureCols`."""
        return self.getFeatureCols()

    def getLabelColumns(self) -> list[str]:
        """Horovod's spelling of :meth:`getLabelCols`."""
        return self.getLabelCols()


class SparkModel(PersistenceMixin, Model, ModelParams):
    """Base of TorchModel / LightningModel / KerasModel.

    Holds the trained framework model (``getModel()``), the training history
    (``getHistory()``), the run id (``getRunId()``) and the per-row output shapes.
    """

    def __init__(
        self,
        *,
        model: object = None,
        history: list[dict[str, float]] | None = None,
        run_id: str | None = None,
        output_shapes: list[tuple[int, ...]] | None = None,
        **params: object,
    ) -> None:
        """Wrap a trained framework model (estimators build models; users load them).

        Parameters
        ----------
        model : object, default None
            The trained framework model, on the CPU.
        history : list of dict, default None
            Per-epoch metrics averaged over the ranks.
        run_id : str, default None
            The run of the fit, whose checkpoints and logs are in the store.
        output_shapes : list of tuple, default None
            The per-row shape of each output.
        **params
            Model Params by name: ``featureCols``, ``labelCols``, ``inputShapes``,
            ``transformBatchSize``, ``outputCols``.
        """
        super().__init__()
        self._model = model
        self._history = list(history or [])
        self._run_id = run_id
        self._output_shapes = [tuple(s) for s in (output_shapes or [])]
        if params:
            self._set(**params)

    # -- getters ---------------------------------------------------------------------------------
    def getModel(self) -> Any:
        """The trained framework model, on the CPU."""
        return self._model

    def getHistory(self) -> History:
        """Per-epoch metrics averaged over the ranks (``epoch``, ``loss``, ``val_loss``, ...).

        A list of one dict per epoch that also takes a metric name, as horovod's dict of lists
        did: ``history[-1]["loss"]`` and ``min(history["val_loss"])`` both work
        (:class:`~spark_estimators.core.history.History`).
        """
        return History(self._history)

    def getRunId(self) -> str | None:
        """The run id of the fit that trained this model (its checkpoints and logs in the store)."""
        return self._run_id

    def setOutputCols(self, value: list[str]) -> SparkModel:
        """Sets the value of ``outputCols``."""
        return self._set(outputCols=value)

    def setTransformBatchSize(self, value: int) -> SparkModel:
        """Sets the value of ``transformBatchSize``."""
        return self._set(transformBatchSize=value)

    def getOutputCols(self) -> list[str]:
        """The prediction columns ``transform`` appends (``<label>__output`` unless set)."""
        return self.output_cols()

    def output_cols(self) -> list[str]:
        """The prediction columns: ``outputCols`` when set, else ``<label>__output`` per label."""
        cols = self.getOrDefault(self.outputCols)
        return list(cols) if cols else [f"{c}__output" for c in self.getLabelCols()]

    # -- persistence hooks -----------------------------------------------------------------------
    def _model_to_bytes(self) -> bytes:
        raise NotImplementedError

    def _model_from_bytes(self, blob: bytes) -> object:
        raise NotImplementedError

    def _predictor(self) -> Predictor:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, object]:
        return {
            "model": self._model_to_bytes(),
            "history": self._history,
            "run_id": self._run_id,
            "output_shapes": self._output_shapes,
        }

    def _restore_extra_state(self, state: dict[str, object]) -> None:
        self._model = self._model_from_bytes(cast(bytes, state["model"]))
        self._history = list(cast("list[dict[str, float]]", state["history"]))
        self._run_id = cast("str | None", state["run_id"])
        self._output_shapes = [
            tuple(s) for s in cast("list[tuple[int, ...]]", state["output_shapes"])
        ]

    # -- transform -------------------------------------------------------------------------------
    def _transform(self, df: DataFrame) -> DataFrame:
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructField, StructType, UserDefinedType

        features = self.getFeatureCols()
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ConfigurationError(
                f"transform: feature column(s) {missing!r} not in the DataFrame"
                f"{did_you_mean(missing, df.columns)}; available: {df.columns!r}"
            )
        outputs = self.output_cols()
        if len(outputs) != len(self._output_shapes):
            raise ConfigurationError(
                f"outputCols has {len(outputs)} names {outputs!r} but the model has "
                f"{len(self._output_shapes)} outputs"
            )
        clash = [c for c in outputs if c in df.columns]
        if clash:
            raise ConfigurationError(
                f"output column(s) {clash!r} already exist in the DataFrame; rename them with "
                "setOutputCols([...])"
            )
        types = {f.name: f.dataType for f in df.schema.fields}
        extra, inputs = [], {}
        for i, col in enumerate(features):
            tmp = f"__se_in_{i}"
            if isinstance(types[col], VectorUDT):
                # Null vectors reach the model's batches as nulls, where the error names the
                # column (vector_to_array fails on them with a bare JVM error).
                array = vector_to_array(F.col(col))
                extra.append(F.when(F.col(col).isNull(), None).otherwise(array).alias(tmp))
            else:
                extra.append(F.col(col).alias(tmp))
            inputs[col] = tmp
        wide = df.select("*", *extra)
        keep = list(range(len(df.columns)))
        schema = StructType(
            list(df.schema.fields)
            + [
                StructField(name, tensors.output_type(shape), False)
                for name, shape in zip(outputs, self._output_shapes, strict=True)
            ]
        )
        blob = self._model_to_bytes()
        try:
            blob_source: object = df.sparkSession.sparkContext.broadcast(blob)
        except Exception:  # Spark Connect: no broadcast, ship in the closure
            blob_source = blob
        spec: PredictSpec = {
            "predictor": self._predictor(),
            # Keyed by content: a model changed after an earlier transform is reloaded.
            "key": hashlib.sha1(blob).hexdigest(),
            "blob": blob_source,
            "inputs": {c: len(df.columns) + i for i, c in enumerate(features)},
            "feature_cols": features,
            "input_shapes": self.getInputShapes(),
            "output_cols": outputs,
            "output_shapes": self._output_shapes,
            "batch_size": self.getTransformBatchSize(),
            "keep": keep,
        }
        # A streaming input with a UDT (vector) column: Spark's Arrow UDF evaluation converts the
        # whole input row to Arrow there and refuses the UDT (UNSUPPORTED_DATATYPE); mapInArrow
        # takes it.
        streaming_udt = df.isStreaming and any(
            isinstance(f.dataType, UserDefinedType) for f in df.schema.fields
        )
        if hasattr(F, "arrow_udf") and not streaming_udt:
            # Spark >= 4.1: only the feature columns go to Python
            from pyspark.sql.functions import ArrowUDFType

            out_type = StructType(schema.fields[len(df.columns) :])
            make_udf: Callable[..., Callable[..., Column]] = F.arrow_udf
            with warnings.catch_warnings():
                # The UDF takes one Arrow array per feature column, a number known only here,
                # so it is declared by type rather than by type hints (pyspark warns about that).
                warnings.filterwarnings(
                    "ignore", message=".*type hints for arrow UDF", category=UserWarning
                )
                udf = make_udf(
                    partial(predict_udf, spec), out_type, functionType=ArrowUDFType.SCALAR_ITER
                )
            tmp = "__se_predictions"
            scored = df.withColumn(tmp, udf(*extra))
            return scored.select(
                *[F.col(f"`{c}`") for c in df.columns],
                *[F.col(tmp).getField(name).alias(name) for name in outputs],
            )
        return wide.mapInArrow(partial(predict_batches, spec), schema)
