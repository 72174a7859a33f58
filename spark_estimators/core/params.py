"""Spark ML Params shared by every estimator and model, declared the pyspark way.

Horovod's snake_case constructor keywords (``num_proc``, ``feature_cols``, ...) map to camelCase
Params through one alias table, :data:`ALIASES`, as xgboost.spark does. Params that hold Python
objects (model, optimizer, store, callbacks, ...) use ``TypeConverters.identity``.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasOutputCols


def make_param(name: str, doc: str, conv: Any = TypeConverters.identity) -> Param:
    """A Spark ML ``Param`` named ``name`` with ``doc`` and a type converter."""
    return Param(Params._dummy(), name, doc, typeConverter=conv)


def _to_int_or_none(value: Any) -> int | None:
    return None if value is None else TypeConverters.toInt(value)


def _to_list_or_none(value: Any) -> list[Any] | None:
    return None if value is None else TypeConverters.toList(value)


def _to_str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def _to_str_or_none(value: Any) -> str | None:
    return None if value is None else TypeConverters.toString(value)


# snake_case (horovod) -> camelCase (Spark ML).
ALIASES: dict[str, str] = {
    "num_proc": "numProc",
    "collective_backend": "collectiveBackend",
    "loss_constructors": "lossConstructors",
    "loss_weights": "lossWeights",
    "sample_weight_col": "sampleWeightCol",
    "feature_cols": "featureCols",
    "label_cols": "labelCols",
    "input_shapes": "inputShapes",
    "label_shapes": "labelShapes",
    "batch_size": "batchSize",
    "val_batch_size": "valBatchSize",
    "train_steps_per_epoch": "trainStepsPerEpoch",
    "validation_steps_per_epoch": "validationStepsPerEpoch",
    "random_seed": "randomSeed",
    "run_id": "runId",
    "transformation_fn": "transformationFn",
    "inmemory_cache_all": "inmemoryCacheAll",
    "use_gpu": "useGpu",
    "backward_passes_per_step": "backwardPassesPerStep",
    "gradient_compression": "gradientCompression",
    "partitions_per_process": "partitionsPerProcess",
    "train_reader_num_workers": "trainReaderNumWorkers",
    "val_reader_num_workers": "valReaderNumWorkers",
    "train_minibatch_fn": "trainMinibatchFn",
    "scale_lr": "scaleLr",
    "output_cols": "outputCols",
    "start_timeout": "startTimeout",
    "custom_objects": "customObjects",
    "checkpoint_callback": "checkpointCallback",
    "backend_env": "backendEnv",
    "num_gpus": "numGpus",
    "log_every_n_steps": "logEveryNSteps",
    "trainer_args": "trainerArgs",
    "terminate_on_nan": "terminateOnNan",
    "loader_num_epochs": "loaderNumEpochs",
    "transform_batch_size": "transformBatchSize",
    "min_num_proc": "minNumProc",
    "reset_limit": "resetLimit",
    "shuffle_buffer_size": "shuffleBufferSize",
    "reader_pool_type": "readerPoolType",
    "mp_start_method": "mpStartMethod",
    "compress_sparse_cols": "compressSparseCols",
    "transformation_edit_fields": "transformationEditFields",
    "transformation_removed_fields": "transformationRemovedFields",
    "data_module": "dataModule",
    "debug_data_loader": "debugDataLoader",
    "train_async_data_loader_queue_size": "trainAsyncDataLoaderQueueSize",
    "val_async_data_loader_queue_size": "valAsyncDataLoaderQueueSize",
    "log_to_mlflow": "logToMlflow",
}


def to_camel(name: str) -> str:
    """The Param name of a constructor keyword (``num_proc`` -> ``numProc``)."""
    return ALIASES.get(name, name)


class EstimatorParams(HasOutputCols):
    """Params common to every estimator (horovod.spark parity plus our additions)."""

    numProc = make_param("numProc", "number of training processes (Spark tasks)", _to_int_or_none)
    backend = make_param("backend", "Backend object that launches training (default SparkBackend)")
    collectiveBackend = make_param(
        "collectiveBackend", "collective backend: auto, gloo, nccl, mpi", TypeConverters.toString
    )
    store = make_param("store", "Store for intermediate data, checkpoints and logs")
    model = make_param("model", "the model to train")
    optimizer = make_param("optimizer", "optimizer (bound to the model's parameters)")
    loss = make_param("loss", "loss function, or a list of them, one per label column")
    lossConstructors = make_param("lossConstructors", "callables that build the loss functions")
    lossWeights = make_param("lossWeights", "weights of each label's loss", _to_list_or_none)
    sampleWeightCol = make_param(
        "sampleWeightCol", "column of per-row loss weights", _to_str_or_none
    )
    metrics = make_param("metrics", "metric functions metric(output, label) -> value")
    featureCols = make_param("featureCols", "feature column names", _to_str_list)
    labelCols = make_param("labelCols", "label column names", _to_str_list)
    inputShapes = make_param("inputShapes", "shape of each feature input, without the batch dim")
    labelShapes = make_param("labelShapes", "shape of each label, without the batch dim")
    validation = make_param(
        "validation", "fraction of rows or a column name marking validation rows"
    )
    callbacks = make_param("callbacks", "training callbacks")
    batchSize = make_param("batchSize", "rows per batch and rank", TypeConverters.toInt)
    valBatchSize = make_param("valBatchSize", "validation rows per batch and rank", _to_int_or_none)
    epochs = make_param("epochs", "number of epochs", TypeConverters.toInt)
    trainStepsPerEpoch = make_param(
        "trainStepsPerEpoch", "steps per epoch (None: all)", _to_int_or_none
    )
    validationStepsPerEpoch = make_param(
        "validationStepsPerEpoch", "validation steps per epoch (None: all)", _to_int_or_none
    )
    shuffle = make_param(
        "shuffle", "shuffle the training data every epoch", TypeConverters.toBoolean
    )
    randomSeed = make_param("randomSeed", "seed for shuffling and model init", _to_int_or_none)
    runId = make_param(
        "runId", "id of the run in the store; reuse it to hot-start", _to_str_or_none
    )
    transformationFn = make_param("transformationFn", "fn(pandas.DataFrame) applied to each batch")
    inmemoryCacheAll = make_param(
        "inmemoryCacheAll", "keep each rank's shard in memory", TypeConverters.toBoolean
    )
    useGpu = make_param("useGpu", "train on the task's GPU when one is assigned")
    backwardPassesPerStep = make_param(
        "backwardPassesPerStep", "local gradient accumulation steps", TypeConverters.toInt
    )
    gradientCompression = make_param("gradientCompression", "Compression.none or Compression.fp16")
    partitionsPerProcess = make_param(
        "partitionsPerProcess", "Parquet partitions per training process", _to_int_or_none
    )
    trainReaderNumWorkers = make_param(
        "trainReaderNumWorkers", "reader threads for training data", TypeConverters.toInt
    )
    valReaderNumWorkers = make_param(
        "valReaderNumWorkers", "reader threads for validation data", TypeConverters.toInt
    )
    reader = make_param(
        "reader", "data reader: 'arrow' (default) or 'petastorm'", TypeConverters.toString
    )
    scaleLr = make_param(
        "scaleLr", "multiply the learning rate by the number of ranks", TypeConverters.toBoolean
    )
    startTimeout = make_param(
        "startTimeout", "seconds for all tasks to start", TypeConverters.toFloat
    )
    verbose = make_param("verbose", "0 quiet, 1 progress bar and epoch lines", TypeConverters.toInt)
    transformBatchSize = make_param(
        "transformBatchSize", "rows per inference batch in transform()", TypeConverters.toInt
    )
    elastic = make_param(
        "elastic",
        "when a rank fails, relaunch the training within the same fit from the last checkpoint",
        TypeConverters.toBoolean,
    )
    minNumProc = make_param(
        "minNumProc",
        "elastic: fewest ranks a relaunch may go on with when slots are missing (default numProc)",
        _to_int_or_none,
    )
    resetLimit = make_param(
        "resetLimit", "elastic: most relaunches within one fit", TypeConverters.toInt
    )
    shuffleBufferSize = make_param(
        "shuffleBufferSize",
        "rows of the reader's shuffle buffer (None: automatic; 0: no shuffling)",
        _to_int_or_none,
    )
    readerPoolType = make_param(
        "readerPoolType", "horovod/petastorm worker pool: only 'thread' (the reader's threads)"
    )
    mpStartMethod = make_param(
        "mpStartMethod", "horovod compatibility: only None (no multiprocessing pool is used)"
    )
    compressSparseCols = make_param(
        "compressSparseCols",
        "store mostly-zero vector columns sparsely in the prepared data",
        TypeConverters.toBoolean,
    )
    transformationEditFields = make_param(
        "transformationEditFields", "petastorm TransformSpec fields; not needed (only None)"
    )
    logToMlflow = make_param(
        "logToMlflow",
        "MLflow tracking: None logs into an active run, True always (starting a run), False never",
    )
    transformationRemovedFields = make_param(
        "transformationRemovedFields", "petastorm TransformSpec fields; not needed (only None)"
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            numProc=None,
            backend=None,
            collectiveBackend="auto",
            store=None,
            model=None,
            optimizer=None,
            loss=None,
            lossConstructors=None,
            lossWeights=None,
            sampleWeightCol=None,
            metrics=None,
            featureCols=[],
            labelCols=[],
            inputShapes=None,
            labelShapes=None,
            validation=None,
            callbacks=None,
            batchSize=32,
            valBatchSize=None,
            epochs=1,
            trainStepsPerEpoch=None,
            validationStepsPerEpoch=None,
            shuffle=True,
            randomSeed=None,
            runId=None,
            transformationFn=None,
            inmemoryCacheAll=False,
            useGpu=None,
            backwardPassesPerStep=1,
            gradientCompression=None,
            partitionsPerProcess=None,
            trainReaderNumWorkers=2,
            valReaderNumWorkers=2,
            reader="arrow",
            scaleLr=True,
            startTimeout=60.0,
            verbose=1,
            transformBatchSize=1024,
            elastic=False,
            minNumProc=None,
            resetLimit=3,
            shuffleBufferSize=None,
            readerPoolType="thread",
            mpStartMethod=None,
            compressSparseCols=False,
            transformationEditFields=None,
            transformationRemovedFields=None,
            logToMlflow=None,
            outputCols=[],
        )

    # Typed getters (pyspark style). getOutputCols comes from HasOutputCols.
    def getNumProc(self) -> int | None:
        """Gets the value of ``numProc`` or its default value."""
        return self.getOrDefault(self.numProc)

    def getBackend(self) -> Any:
        """Gets the value of ``backend`` or its default value."""
        return self.getOrDefault(self.backend)

    def getCollectiveBackend(self) -> str:
        """Gets the value of ``collectiveBackend`` or its default value."""
        return self.getOrDefault(self.collectiveBackend)

    def getStore(self) -> Any:
        """Gets the value of ``store`` or its default value."""
        return self.getOrDefault(self.store)

    def getModel(self) -> Any:
        """Gets the value of ``model`` or its default value."""
        return self.getOrDefault(self.model)

    def getOptimizer(self) -> Any:
        """Gets the value of ``optimizer`` or its default value."""
        return self.getOrDefault(self.optimizer)

    def getLoss(self) -> Any:
        """Gets the value of ``loss`` or its default value."""
        return self.getOrDefault(self.loss)

    def getLossWeights(self) -> list[float] | None:
        """Gets the value of ``lossWeights`` or its default value."""
        return self.getOrDefault(self.lossWeights)

    def getSampleWeightCol(self) -> str | None:
        """Gets the value of ``sampleWeightCol`` or its default value."""
        return self.getOrDefault(self.sampleWeightCol)

    def getMetrics(self) -> Any:
        """Gets the value of ``metrics`` or its default value."""
        return self.getOrDefault(self.metrics)

    def getFeatureCols(self) -> list[str]:
        """Gets the value of ``featureCols`` or its default value."""
        return self.getOrDefault(self.featureCols)

    def getLabelCols(self) -> list[str]:
        """Gets the value of ``labelCols`` or its default value."""
        return self.getOrDefault(self.labelCols)

    def getInputShapes(self) -> Any:
        """Gets the value of ``inputShapes`` or its default value."""
        return self.getOrDefault(self.inputShapes)

    def getLabelShapes(self) -> Any:
        """Gets the value of ``labelShapes`` or its default value."""
        return self.getOrDefault(self.labelShapes)

    def getValidation(self) -> Any:
        """Gets the value of ``validation`` or its default value."""
        return self.getOrDefault(self.validation)

    def getCallbacks(self) -> Any:
        """Gets the value of ``callbacks`` or its default value."""
        return self.getOrDefault(self.callbacks)

    def getBatchSize(self) -> int:
        """Gets the value of ``batchSize`` or its default value."""
        return self.getOrDefault(self.batchSize)

    def getValBatchSize(self) -> int | None:
        """Gets the value of ``valBatchSize`` or its default value."""
        return self.getOrDefault(self.valBatchSize)

    def getEpochs(self) -> int:
        """Gets the value of ``epochs`` or its default value."""
        return self.getOrDefault(self.epochs)

    def getTrainStepsPerEpoch(self) -> int | None:
        """Gets the value of ``trainStepsPerEpoch`` or its default value."""
        return self.getOrDefault(self.trainStepsPerEpoch)

    def getValidationStepsPerEpoch(self) -> int | None:
        """Gets the value of ``validationStepsPerEpoch`` or its default value."""
        return self.getOrDefault(self.validationStepsPerEpoch)

    def getShuffle(self) -> bool:
        """Gets the value of ``shuffle`` or its default value."""
        return self.getOrDefault(self.shuffle)

    def getRandomSeed(self) -> int | None:
        """Gets the value of ``randomSeed`` or its default value."""
        return self.getOrDefault(self.randomSeed)

    def getRunId(self) -> str | None:
        """Gets the value of ``runId`` or its default value."""
        return self.getOrDefault(self.runId)

    def getTransformationFn(self) -> Any:
        """Gets the value of ``transformationFn`` or its default value."""
        return self.getOrDefault(self.transformationFn)

    def getInmemoryCacheAll(self) -> bool:
        """Gets the value of ``inmemoryCacheAll`` or its default value."""
        return self.getOrDefault(self.inmemoryCacheAll)

    def getUseGpu(self) -> bool | None:
        """Gets the value of ``useGpu`` or its default value."""
        return self.getOrDefault(self.useGpu)

    def getBackwardPassesPerStep(self) -> int:
        """Gets the value of ``backwardPassesPerStep`` or its default value."""
        return self.getOrDefault(self.backwardPassesPerStep)

    def getGradientCompression(self) -> Any:
        """Gets the value of ``gradientCompression`` or its default value."""
        return self.getOrDefault(self.gradientCompression)

    def getPartitionsPerProcess(self) -> int | None:
        """Gets the value of ``partitionsPerProcess`` or its default value."""
        return self.getOrDefault(self.partitionsPerProcess)

    def getTrainReaderNumWorkers(self) -> int:
        """Gets the value of ``trainReaderNumWorkers`` or its default value."""
        return self.getOrDefault(self.trainReaderNumWorkers)

    def getValReaderNumWorkers(self) -> int:
        """Gets the value of ``valReaderNumWorkers`` or its default value."""
        return self.getOrDefault(self.valReaderNumWorkers)

    def getReader(self) -> str:
        """Gets the value of ``reader`` or its default value."""
        return self.getOrDefault(self.reader)

    def getScaleLr(self) -> bool:
        """Gets the value of ``scaleLr`` or its default value."""
        return self.getOrDefault(self.scaleLr)

    def getStartTimeout(self) -> float:
        """Gets the value of ``startTimeout`` or its default value."""
        return self.getOrDefault(self.startTimeout)

    def getVerbose(self) -> int:
        """Gets the value of ``verbose`` or its default value."""
        return self.getOrDefault(self.verbose)

    def getTransformBatchSize(self) -> int:
        """Gets the value of ``transformBatchSize`` or its default value."""
        return self.getOrDefault(self.transformBatchSize)

    def getElastic(self) -> bool:
        """Gets the value of ``elastic`` or its default value."""
        return self.getOrDefault(self.elastic)

    def getMinNumProc(self) -> int | None:
        """Gets the value of ``minNumProc`` or its default value."""
        return self.getOrDefault(self.minNumProc)

    def getResetLimit(self) -> int:
        """Gets the value of ``resetLimit`` or its default value."""
        return self.getOrDefault(self.resetLimit)

    def getShuffleBufferSize(self) -> int | None:
        """Gets the value of ``shuffleBufferSize`` or its default value."""
        return self.getOrDefault(self.shuffleBufferSize)

    def getCompressSparseCols(self) -> bool:
        """Gets the value of ``compressSparseCols`` or its default value."""
        return self.getOrDefault(self.compressSparseCols)

    # horovod's spellings of a few accessors
    def getShufflingBufferSize(self) -> int | None:
        """Horovod's spelling of :meth:`getShuffleBufferSize`."""
        return self.getShuffleBufferSize()

    def setShufflingBufferSize(self, value: int | None) -> Any:
        """Sets the value of ``shuffleBufferSize``."""
        return self._set(shuffleBufferSize=value)

    def getTrainReaderNumWorker(self) -> int:
        """Horovod's spelling of :meth:`getTrainReaderNumWorkers`."""
        return self.getTrainReaderNumWorkers()

    def setTrainReaderNumWorker(self, value: int) -> Any:
        """Sets the value of ``trainReaderNumWorkers``."""
        return self._set(trainReaderNumWorkers=value)

    def getValReaderNumWorker(self) -> int:
        """Horovod's spelling of :meth:`getValReaderNumWorkers`."""
        return self.getValReaderNumWorkers()

    def setValReaderNumWorker(self, value: int) -> Any:
        """Sets the value of ``valReaderNumWorkers``."""
        return self._set(valReaderNumWorkers=value)

    def getInMemoryCacheAll(self) -> bool:
        """Horovod's spelling of :meth:`getInmemoryCacheAll`."""
        return self.getInmemoryCacheAll()

    def setInMemoryCacheAll(self, value: bool) -> Any:
        """Sets the value of ``inmemoryCacheAll``."""
        return self._set(inmemoryCacheAll=value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        add_accessors(cls)


def add_accessors(cls: type) -> type:
    """Give ``cls`` a ``getX()`` and a ``setX(value)`` (returning self) for every Param ``x``.

    The pyspark.ml way (``est.setEpochs(5).setBatchSize(64)``); explicit methods win.
    """
    for name in dir(cls):
        param = getattr(cls, name, None)
        if not isinstance(param, Param) or name != param.name:
            continue
        suffix = name[0].upper() + name[1:]
        if not hasattr(cls, "set" + suffix):
            setattr(cls, "set" + suffix, _setter(name))
        if not hasattr(cls, "get" + suffix):
            setattr(cls, "get" + suffix, _getter(name))
    return cls


def _setter(name: str) -> Any:
    def setter(self: Params, value: Any) -> Params:
        return self._set(**{name: value})

    setter.__name__ = "set" + name[0].upper() + name[1:]
    setter.__doc__ = f"Set the ``{name}`` param; returns self."
    return setter


def _getter(name: str) -> Any:
    def getter(self: Params) -> Any:
        return self.getOrDefault(name)

    getter.__name__ = "get" + name[0].upper() + name[1:]
    getter.__doc__ = f"The ``{name}`` param's value (or its default)."
    return getter


# Horovod parameters with no equivalent here: a value other than the default is refused with the
# alternative (they were accepted and silently ignored before).
UNSUPPORTED: dict[str, tuple[str, Any, str]] = {
    "readerPoolType": (
        "reader_pool_type",
        ("thread", None),
        "the reader decodes with pyarrow's threads, not a petastorm pool; use "
        "train_reader_num_workers / val_reader_num_workers to set its parallelism",
    ),
    "mpStartMethod": (
        "mp_start_method",
        (None,),
        "no multiprocessing pool is used: each rank is a fresh process started by its Spark "
        "task and the reader uses threads; remove mp_start_method",
    ),
    "transformationEditFields": (
        "transformation_edit_fields",
        (None,),
        "transformation_fn returns a pandas DataFrame whose columns may be added or removed "
        "freely (no petastorm TransformSpec schema to edit); remove it",
    ),
    "transformationRemovedFields": (
        "transformation_removed_fields",
        (None,),
        "transformation_fn may drop columns itself (no petastorm TransformSpec schema to "
        "edit); remove it",
    ),
}


def check_unsupported(est: Params) -> None:
    """Refuse horovod parameters that have no effect here, naming what to use instead."""
    from spark_estimators.errors import ConfigurationError

    table = dict(UNSUPPORTED)
    table.update(getattr(est, "_unsupported", {}))
    for name, (keyword, allowed, why) in table.items():
        if not est.hasParam(name):
            continue
        value = est.getOrDefault(name)
        if not any(value is a or (a is not None and value == a) for a in allowed):
            raise ConfigurationError(f"{keyword}={value!r} is not supported: {why}")
    size = est.getOrDefault("shuffleBufferSize") if est.hasParam("shuffleBufferSize") else None
    if size is not None and (isinstance(size, bool) or size < 0):
        raise ConfigurationError(
            f"shuffle_buffer_size={size!r} is invalid: expected None (automatic), 0 (no "
            "shuffling) or a positive number of rows"
        )


add_accessors(EstimatorParams)
