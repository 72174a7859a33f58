"""KerasEstimator: fit a Keras 3 model on a Spark DataFrame, data-parallel on Spark tasks.

>>> est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.1),
...                      loss="binary_crossentropy", metrics=["accuracy"],
...                      feature_cols=["features"], label_cols=["y"], batch_size=32,
...                      epochs=10, validation=0.1)  # doctest: +SKIP
>>> keras_model = est.fit(df).setOutputCols(["predict"])  # doctest: +SKIP
>>> keras_model.getModel().predict(np.ones([1, 2], dtype=np.float32))  # doctest: +SKIP

Design: every rank runs Keras's own ``model.fit`` on its shard (read by our reader as
``tf.data``), compiled with the user's loss and metrics and a
:func:`~spark_estimators.collective.keras.DistributedOptimizer`, which averages the gradients
of every step with one fused allreduce inside ``Optimizer.apply``. So users get real Keras
semantics: compile-time metrics, their callbacks (``EarlyStopping``, ``ModelCheckpoint``,
``ReduceLROnPlateau``, ``LearningRateScheduler``, custom ones) and ``History``, with correct
averaged gradients; the ranks' trainable weights stay bitwise identical (BatchNormalization's
moving statistics are per rank; ``average_running_stats`` averages them at the end).
``MultiWorkerMirroredStrategy`` was rejected:
Keras 3 ``fit`` under it is broken upstream and ``tf_keras`` is not in our stack. The callback
order that keeps ranks in agreement is documented in :mod:`spark_estimators.keras.remote`.

Learning rate: pass the rate you would use on one process (the seed's "unscaled learning
rate"); it is multiplied by the number of ranks, as Horovod's estimators do, because the
effective batch is ``num_proc * batch_size``. ``scale_lr=False`` keeps it as given. A
``LearningRateSchedule`` is not scaled: scale it yourself and pass ``scale_lr=False``.

Checkpoints and logs: after every epoch rank 0 writes ``runs/<run_id>/checkpoints/
checkpoint.keras`` (model + optimizer state) and ``checkpoint.json`` (epoch, history). A fit
with the ``run_id`` of an earlier run resumes after its last epoch (``epochs`` is the total).
``ModelCheckpoint`` and ``TensorBoard`` callbacks run on rank 0 only and write into the run's
``checkpoints/`` and ``logs/``; ``checkpoint_callback`` (a ``ModelCheckpoint``) decides which
weights come back: with ``save_best_only=True`` the returned model is the best epoch's.

Custom objects: what the model, ``loss`` and ``metrics`` need is found the way Keras finds it
(registered objects under ``"package>name"`` and their plain name, the functions and objects
passed as ``loss``/``metrics``, classes and functions of modules the driver has imported; see
:mod:`spark_estimators.keras.serialization`) and shipped by value with ``custom_objects`` (which
win on a clash) to the ranks, which register the ``"package>name"`` ones again, and to
``transform``; they are used wherever the model is loaded. A fit never loses its trained model
to a loss or metric that cannot be saved or loaded: the model comes back uncompiled, with a
warning (:func:`~spark_estimators.keras.model.warn_uncompiled`).

Input shapes: without ``input_shapes`` the shapes of the model's inputs are used, as horovod's
KerasEstimator does (``model.inputs[i]`` shapes ``feature_cols[i]``): a 784-long vector column
feeds ``keras.Input((28, 28, 1))`` as ``[-1, 28, 28, 1]``. One unknown dimension besides the
batch becomes ``-1`` (filled from the row's length); inputs with more unknown dimensions, and
models without declared inputs, get the columns as they are. A column whose rows cannot fill the
model's input fails in the driver before training, naming the column, the shape and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from spark_estimators.core import checks
from spark_estimators.core.estimator import SparkEstimator, listify
from spark_estimators.core.framework import FitData, FrameworkBase, RankResult, extend_spec
from spark_estimators.core.params import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    SupervisedParams,
    document_constructor,
    make_param,
)
from spark_estimators.core.params.base import keyword_only
from spark_estimators.core.tensors import check_shapes
from spark_estimators.core.training_run import TrainingRun, wrap_model
from spark_estimators.errors import ConfigurationError
from spark_estimators.keras.model import (
    KerasModel,
    dumps_custom_objects,
    load_keras_model,
    warn_uncompiled,
)
from spark_estimators.keras.outputs import (
    check_named_outputs,
    check_output_widths,
    vector_outputs,
)

if TYPE_CHECKING:
    import keras

    from spark_estimators.core.checkpoint import CheckpointInfo
    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.data.metadata import ColumnInfo
    from spark_estimators.keras.remote import KerasTrainSpec, KerasUserObjects
    from spark_estimators.store.base import Store


class KerasEstimator(SparkEstimator, SupervisedParams):
    """Spark ML Estimator that trains a Keras 3 model (TensorFlow backend) with allreduce.

    Its keywords are horovod.spark.keras's (snake_case keywords or camelCase Params), listed in
    the constructor's Parameters. ``model`` is a Keras model (compiled or not; it is compiled on
    the ranks), ``optimizer`` a ``keras.optimizers.Optimizer`` (its config is used; state starts
    fresh), ``loss`` a Keras loss (name, function or object; a list or dict for several
    outputs), ``metrics`` as for ``model.compile``. ``backend_env`` adds environment variables
    to the ranks of the default backend. ``backward_passes_per_step`` must be 1 (use the
    optimizer's ``gradient_accumulation_steps``).
    """

    _horovod_only = {
        **HOROVOD_DATA_MODULE_KEYWORDS,
        "tensorflow_dataset_prefetch_buffer_size": (
            (None, 0),
            "the reader prefetches batches on its own thread; use train_reader_num_workers / "
            "val_reader_num_workers, or remove it",
        ),
    }
    _not_taken = {
        "loss_constructors": (
            (None, []),
            "pass loss= (a Keras loss name, function or object; a list or dict for several "
            "outputs)",
        ),
        "train_minibatch_fn": (
            (None,),
            "Keras's model.fit runs the training step; override train_step() in the model for "
            "a custom one",
        ),
    }

    customObjects = make_param(
        "customObjects", "dict name -> custom class/function for loading the model"
    )
    checkpointCallback = make_param(
        "checkpointCallback", "a keras.callbacks.ModelCheckpoint; decides the returned weights"
    )
    backendEnv = make_param("backendEnv", "dict of environment variables for the ranks")

    _defaults: ClassVar[dict[str, Any]] = {
        "customObjects": None,
        "checkpointCallback": None,
        "backendEnv": None,
    }

    @keyword_only
    def __init__(
        self,
        *,
        model: keras.Model | None = None,
        optimizer: keras.optimizers.Optimizer | str | None = None,
        loss: object = None,
        **params: object,
    ) -> None:
        super().__init__(**self._input_kwargs)

    def getCustomObjects(self) -> dict[str, object]:
        """Gets the value of ``customObjects`` or its default value."""
        return dict(self.getOrDefault("customObjects") or {})

    def _custom_objects_for(self, model_bytes: bytes | None) -> dict[str, object]:
        """``custom_objects`` plus what the model, loss and metrics need (Keras's lookup)."""
        from spark_estimators.keras.serialization import find_custom_objects

        found = find_custom_objects(model_bytes, self.getLoss(), self.getMetrics())
        return {**found, **self.getCustomObjects()}

    def getCheckpointCallback(self) -> keras.callbacks.ModelCheckpoint | None:
        """Gets the value of ``checkpointCallback`` or its default value."""
        return self.getOrDefault("checkpointCallback")

    def getInputShapes(self) -> list[list[int] | None] | None:
        """Gets ``inputShapes``; when unset, the shapes of the Keras model's inputs.

        Each ``model.inputs[i]`` shape ``(None, 28, 28, 1)`` gives ``[-1, 28, 28, 1]`` for
        ``feature_cols[i]`` (horovod's rule); see the module docstring for unknown dimensions.
        None when neither is known.
        """
        shapes = self.getOrDefault("inputShapes")
        if shapes is not None:
            return list(shapes)
        return model_input_shapes(self.getModel(), len(self.getFeatureCols()))

    def _check_data_shapes(self, columns: dict[str, ColumnInfo]) -> None:
        if self.getOrDefault("inputShapes") is not None:
            super()._check_data_shapes(columns)
            return
        sizes = {name: int(math.prod(info.shape)) for name, info in columns.items()}
        param = "the Keras model's inputs (input_shapes is unset, so model.inputs decide)"
        check_shapes(param, self.getFeatureCols(), self.getInputShapes(), sizes)
        check_shapes("label_shapes", self.getLabelCols(), self.getLabelShapes(), sizes)

    def getBackendEnv(self) -> dict[str, str]:
        """Gets the value of ``backendEnv`` or its default value."""
        return dict(self.getOrDefault("backendEnv") or {})

    # -- validation ------------------------------------------------------------------------------
    def _validate_framework(self) -> None:
        keras = checks.import_framework(
            "keras", "KerasEstimator needs TensorFlow and Keras 3", "spark-estimators[keras]"
        )
        if keras.backend.backend() != "tensorflow":
            raise ConfigurationError(
                f"KerasEstimator needs the TensorFlow Keras backend, got "
                f"KERAS_BACKEND={keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow"
            )
        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise ConfigurationError(f"model must be a keras.Model, got {type(model).__name__}")
        optimizer = self._optimizer()
        from spark_estimators.collective.keras.optimizer import is_distributed

        if is_distributed(optimizer):
            raise ConfigurationError(
                "optimizer is already a DistributedOptimizer: pass the plain Keras optimizer, "
                "the estimator wraps it"
            )
        lr = getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)
        if self.getScaleLr() and lr is not None and not hasattr(lr, "assign"):
            raise ConfigurationError(
                "scale_lr=True multiplies a constant learning rate by num_proc, but the optimizer "
                "has a LearningRateSchedule: scale the schedule yourself and pass scale_lr=False"
            )
        inputs = _declared_inputs(model)
        if inputs is not None and len(inputs) != len(self.getFeatureCols()):
            raise ConfigurationError(
                f"the Keras model has {len(inputs)} input(s) but feature_cols names "
                f"{len(self.getFeatureCols())} column(s) {self.getFeatureCols()!r}: give one "
                "feature column per model input, in the order of model.inputs"
            )
        if self.getLoss() is None:
            raise ConfigurationError(
                "loss is required: pass loss='mse' (a Keras loss name, function or object; a list "
                "or dict for several outputs)"
            )
        losses = self.getLoss()
        if isinstance(losses, list | tuple) and len(losses) not in (1, len(self.getLabelCols())):
            raise ConfigurationError(
                f"{len(losses)} losses for {len(self.getLabelCols())} label columns: give one "
                "loss, or one per label column"
            )
        named = {"loss": losses, "loss_weights": self.getLossWeights()}
        check_named_outputs(model, self.getLabelCols(), {**named, "metrics": self.getMetrics()})
        if self.getBackwardPassesPerStep() != 1:
            raise ConfigurationError(
                f"backward_passes_per_step={self.getBackwardPassesPerStep()!r} is not supported "
                "by KerasEstimator: give the Keras optimizer gradient_accumulation_steps=k"
            )
        if self._compression_name() not in ("none", "fp16"):
            raise ConfigurationError(
                f"gradient_compression={self.getGradientCompression()!r} is not "
                "Compression.none or Compression.fp16"
            )
        for cb in listify(self.getCallbacks()):
            if not isinstance(cb, keras.callbacks.Callback):
                raise ConfigurationError(
                    f"callbacks must be keras.callbacks.Callback instances, got {type(cb).__name__}"
                )
        ckpt = self.getCheckpointCallback()
        if ckpt is not None and not isinstance(ckpt, keras.callbacks.ModelCheckpoint):
            raise ConfigurationError(
                f"checkpoint_callback must be a keras.callbacks.ModelCheckpoint, got "
                f"{type(ckpt).__name__}"
            )
        custom = self.getOrDefault("customObjects")
        if custom is not None and not (
            isinstance(custom, dict) and all(isinstance(k, str) for k in custom)
        ):
            raise ConfigurationError(
                f"custom_objects must be a dict of name -> class or function, got {custom!r}"
            )
        env = self.getOrDefault("backendEnv")
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
            raise ConfigurationError(f"backend_env must be a dict of str -> str, got {env!r}")

    def _optimizer(self) -> keras.optimizers.Optimizer:
        import keras

        optimizer = self.getOptimizer()
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigurationError(
                f"optimizer must be a keras.optimizers.Optimizer (or its name), got "
                f"{type(optimizer).__name__}; e.g. optimizer=keras.optimizers.SGD(0.1)"
            )
        return optimizer

    def _training_run(self) -> TrainingRun:
        return TrainingRun(self, KerasFramework(self))


class KerasFramework(FrameworkBase["KerasEstimator"]):
    """What a Keras fit adds to its TrainingRun (see :mod:`spark_estimators.core.framework`)."""

    name = "keras"
    #: Per label (so per output): was it an ML vector column? Set from the data by build_spec.
    vector_outputs: tuple[bool, ...] = ()

    def trainer(self) -> Callable[[KerasTrainSpec], RankResult]:
        """The rank entry point: :func:`spark_estimators.keras.remote.train` (imports keras)."""
        from spark_estimators.keras.remote import train

        return train

    def rank_env(self) -> dict[str, str]:
        """``backend_env``: environment variables for the ranks of the default backend."""
        return {k: str(v) for k, v in self.est.getBackendEnv().items()}

    def shipped(self) -> tuple[KerasUserObjects, list[object]]:
        """The optimizer's recipe, loss, metrics, callbacks and functions (not the model)."""
        from spark_estimators.keras.remote import KerasUserObjects, optimizer_recipe

        est = self.est
        user = KerasUserObjects(
            optimizer_recipe=optimizer_recipe(est._optimizer()),
            loss=est.getLoss(),
            metrics=est.getMetrics(),
            callbacks=listify(est.getCallbacks()),
            checkpoint_callback=est.getCheckpointCallback(),
            transformation_fn=est.getTransformationFn(),
        )
        roots = [
            user.optimizer_recipe[0],
            *_pickling_roots(user.loss),
            *_pickling_roots(user.metrics),
        ]
        return user, roots

    def build_spec(
        self, shared: TrainSpec, data: FitData, store: Store, info: CheckpointInfo | None
    ) -> KerasTrainSpec:
        """The Keras spec: the model as ``.keras`` bytes and the custom objects it needs."""
        from spark_estimators.keras.remote import KerasTrainSpec, model_to_bytes

        est = self.est
        self.vector_outputs = tuple(vector_outputs(est.getLabelCols(), dict(data.columns)))
        try:
            # Without its compile state: the ranks compile with loss= and metrics=.
            model_bytes = model_to_bytes(est.getModel(), compile_state=False)
        except Exception as exc:
            raise ConfigurationError(
                f"the model cannot be saved in the .keras format ({type(exc).__name__}: {exc}); "
                "custom layers need get_config() (and custom_objects=...)"
            ) from exc
        return extend_spec(
            shared,
            KerasTrainSpec,
            model_bytes=model_bytes,
            custom_objects_blob=dumps_custom_objects(est._custom_objects_for(model_bytes)),
            loss_weights=est.getLossWeights(),
            compression=est._compression_name(),
            scale_lr=est.getScaleLr(),
            verbose=est.getVerbose(),
        )

    def check_spec(self, spec: TrainSpec, store: Store, data: FitData) -> float:
        """Keras builds its model with shapes: the output width is compared, nothing is run."""
        self._check_output_width(data)
        return 0.0

    def _check_output_width(self, data: FitData) -> None:
        """One output and one label with a loss that needs equal widths: compare them.

        The driver-side check of issue 27 (Keras builds its model with shapes, so no forward
        pass is needed): ``loss="mse"`` on a 2-wide output and a scalar label would broadcast.
        """
        outputs = list(getattr(self.est.getModel(), "outputs", None) or [])
        labels = self.est.getLabelCols()
        loss = self.est.getLoss()
        columns = dict(data.columns)
        check_output_widths(self.est.getModel(), labels, loss, columns, _SAME_WIDTH_LOSSES)
        if len(outputs) != 1 or len(labels) != 1 or isinstance(loss, list | tuple | dict):
            return
        name = loss if isinstance(loss, str) else getattr(loss, "name", None)
        name = name or getattr(loss, "__name__", "")
        if str(name).lower() not in _SAME_WIDTH_LOSSES:
            return
        dims = list(outputs[0].shape[1:])
        info = columns.get(labels[0])
        if info is None or any(d is None for d in dims):
            return
        width, label_width = math.prod(dims), math.prod(info.shape)
        if width != label_width:
            raise ConfigurationError(
                f"the model outputs {width} value(s) per row but label column {labels[0]!r} "
                f"holds {label_width}: make the last layer output {label_width} (e.g. "
                f"keras.layers.Dense({label_width})), or use a label with {width} values per row "
                f"(loss={name!r} needs both the same width; for class indices use "
                "'sparse_categorical_crossentropy')"
            )

    def build_model(self, results: list[RankResult], run_id: str) -> KerasModel:
        """A KerasModel of rank 0's trained model, loaded with its custom objects."""
        fingerprints = checks.check_fingerprints(results)
        custom = self.est._custom_objects_for(results[0]["model"])
        if results[0].get("compile_state_error"):
            warn_uncompiled(results[0]["compile_state_error"])
        # Never loses the trained model: uncompiled (with the warning) when its loss or metrics
        # cannot be loaded.
        model = load_keras_model(results[0]["model"], custom)
        keras_model = wrap_model(
            self.est,
            KerasModel,
            model,
            results,
            run_id,
            custom_objects=custom,
            vector_outputs=list(self.vector_outputs),
        )
        keras_model._rank_fingerprints = fingerprints
        return keras_model


# Losses whose output and label have the same width (not the sparse categorical ones).
_SAME_WIDTH_LOSSES = {
    "mse",
    "mae",
    "mape",
    "msle",
    "mean_squared_error",
    "mean_absolute_error",
    "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error",
    "huber",
    "huber_loss",
    "log_cosh",
    "binary_crossentropy",
    "categorical_crossentropy",
}


def _pickling_roots(value: object) -> list[object]:
    """The objects of a ``loss``/``metrics`` value, whose modules travel by value.

    Nested lists and dicts are flattened; a ``functools.partial`` adds its function.
    """
    if isinstance(value, dict):
        return [root for item in value.values() for root in _pickling_roots(item)]
    if isinstance(value, list | tuple):
        return [root for item in value for root in _pickling_roots(item)]
    func = getattr(value, "func", None)
    return [value] if func is None else [value, *_pickling_roots(func)]


def _declared_inputs(model: keras.Model) -> list[keras.KerasTensor] | None:
    """``model.inputs`` of a built functional or Sequential model, else None."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed or unbuilt model has none
        return None
    return list(inputs) if inputs else None


def model_input_shapes(model: keras.Model, feature_count: int) -> list[list[int] | None] | None:
    """Input shapes for the feature columns from ``model.inputs``, or None.

    ``(None, 28, 28, 1)`` -> ``[-1, 28, 28, 1]``; one unknown dimension besides the batch ->
    a per-row shape with ``-1`` for it (``(None, None, 8)`` -> ``[-1, 8]``); more than one ->
    None for that input (the column is fed as it is).

    >>> import types
    >>> fake = types.SimpleNamespace(inputs=[types.SimpleNamespace(shape=(None, 28, 28, 1))])
    >>> model_input_shapes(fake, 1)
    [[-1, 28, 28, 1]]
    """
    inputs = _declared_inputs(model)
    if inputs is None or len(inputs) != feature_count:
        return None
    shapes: list[list[int] | None] = []
    for tensor in inputs:
        dims = [None if d is None else int(d) for d in tuple(tensor.shape)[1:]]
        unknown = sum(d is None for d in dims)
        if unknown == 0:
            shapes.append([-1, *(int(d) for d in dims if d is not None)])
        elif unknown == 1:
            shapes.append([-1 if d is None else d for d in dims])
        else:
            shapes.append(None)
    return shapes if any(s is not None for s in shapes) else None


document_constructor(
    KerasEstimator,
    """Build a KerasEstimator; every keyword is optional here and checked when fitting.

    ``model`` (a ``keras.Model``), ``optimizer`` and ``loss`` are needed to fit;
    ``feature_cols`` and ``label_cols`` name the columns. Positional arguments raise
    ``TypeError``.
    """,
)
