"""The Params every estimator has, grouped by role, and :class:`EstimatorParams` composing them.

Each group declares its Params (pyspark style: ``make_param`` at class level, a typed getter)
and their defaults in ``_defaults``; ``setX`` and the missing getters are generated. The
supervised Params (optimizer, loss, metrics, ...) are not here: see
:mod:`spark_estimators.core.params.shared`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pyspark.ml.param import TypeConverters
from pyspark.ml.param.shared import HasOutputCols

from spark_estimators.core.params.base import (
    DeclaredParams,
    make_param,
    to_int_or_none,
    to_str_or_none,
)
from spark_estimators.core.params.shared import (
    HasFeatureCols,
    HasInputShapes,
    HasLabelCols,
    HasTransformBatchSize,
)

if TYPE_CHECKING:
    from spark_estimators.core.backend import Backend
    from spark_estimators.store.base import Store


class LaunchParams(DeclaredParams):
    """Where and how the ranks run: processes, backend, store, timeouts, elastic, tracking."""

    numProc = make_param("numProc", "number of training processes (Spark tasks)", to_int_or_none)
    backend = make_param("backend", "Backend object that launches training (default SparkBackend)")
    collectiveBackend = make_param(
        "collectiveBackend", "collective backend: auto, gloo, nccl, mpi", TypeConverters.toString
    )
    store = make_param("store", "Store for intermediate data, checkpoints and logs")
    useGpu = make_param("useGpu", "train on the task's GPU when one is assigned")
    startTimeout = make_param(
        "startTimeout", "seconds for all tasks to start", TypeConverters.toFloat
    )
    verbose = make_param("verbose", "0 quiet, 1 progress bar and epoch lines", TypeConverters.toInt)
    runId = make_param("runId", "id of the run in the store; reuse it to hot-start", to_str_or_none)
    elastic = make_param(
        "elastic",
        "when a rank fails, relaunch the training within the same fit from the last checkpoint",
        TypeConverters.toBoolean,
    )
    minNumProc = make_param(
        "minNumProc",
        "elastic: fewest ranks a relaunch may go on with when slots are missing (default numProc)",
        to_int_or_none,
    )
    resetLimit = make_param(
        "resetLimit", "elastic: most relaunches within one fit", TypeConverters.toInt
    )
    logToMlflow = make_param(
        "logToMlflow",
        "MLflow tracking: None logs into an active run, True always (starting a run), False never",
    )
    _defaults: ClassVar[dict[str, object]] = {
        "numProc": None,
        "backend": None,
        "collectiveBackend": "auto",
        "store": None,
        "useGpu": None,
        "startTimeout": 60.0,
        "verbose": 1,
        "runId": None,
        "elastic": False,
        "minNumProc": None,
        "resetLimit": 3,
        "logToMlflow": None,
    }

    def getNumProc(self) -> int | None:
        """Gets the value of ``numProc`` or its default value."""
        return self.getOrDefault(self.numProc)

    def getBackend(self) -> Backend | None:
        """Gets the value of ``backend`` or its default value."""
        return self.getOrDefault(self.backend)

    def getCollectiveBackend(self) -> str:
        """Gets the value of ``collectiveBackend`` or its default value."""
        return self.getOrDefault(self.collectiveBackend)

    def getStore(self) -> Store | None:
        """Gets the value of ``store`` or its default value."""
        return self.getOrDefault(self.store)

    def getUseGpu(self) -> bool | None:
        """Gets the value of ``useGpu`` or its default value."""
        return self.getOrDefault(self.useGpu)

    def getStartTimeout(self) -> float:
        """Gets the value of ``startTimeout`` or its default value."""
        return self.getOrDefault(self.startTimeout)

    def getVerbose(self) -> int:
        """Gets the value of ``verbose`` or its default value."""
        return self.getOrDefault(self.verbose)

    def getRunId(self) -> str | None:
        """Gets the value of ``runId`` or its default value."""
        return self.getOrDefault(self.runId)

    def getElastic(self) -> bool:
        """Gets the value of ``elastic`` or its default value."""
        return self.getOrDefault(self.elastic)

    def getMinNumProc(self) -> int | None:
        """Gets the value of ``minNumProc`` or its default value."""
        return self.getOrDefault(self.minNumProc)

    def getResetLimit(self) -> int:
        """Gets the value of ``resetLimit`` or its default value."""
        return self.getOrDefault(self.resetLimit)


class DataParams(DeclaredParams):
    """What the ranks read: columns, validation split, batches, the reader and its shuffling."""

    sampleWeightCol = make_param(
        "sampleWeightCol", "column of per-row loss weights", to_str_or_none
    )
    labelShapes = make_param("labelShapes", "shape of each label, without the batch dim")
    validation = make_param(
        "validation", "fraction of rows or a column name marking validation rows"
    )
    batchSize = make_param("batchSize", "rows per batch and rank", TypeConverters.toInt)
    valBatchSize = make_param("valBatchSize", "validation rows per batch and rank", to_int_or_none)
    trainStepsPerEpoch = make_param(
        "trainStepsPerEpoch", "steps per epoch (None: all)", to_int_or_none
    )
    validationStepsPerEpoch = make_param(
        "validationStepsPerEpoch", "validation steps per epoch (None: all)", to_int_or_none
    )
    shuffle = make_param(
        "shuffle", "shuffle the training data every epoch", TypeConverters.toBoolean
    )
    shuffleBufferSize = make_param(
        "shuffleBufferSize",
        "rows of the reader's shuffle buffer (None: automatic; 0: no shuffling)",
        to_int_or_none,
    )
    randomSeed = make_param("randomSeed", "seed for shuffling and model init", to_int_or_none)
    transformationFn = make_param("transformationFn", "fn(pandas.DataFrame) applied to each batch")
    inmemoryCacheAll = make_param(
        "inmemoryCacheAll", "keep each rank's shard in memory", TypeConverters.toBoolean
    )
    partitionsPerProcess = make_param(
        "partitionsPerProcess", "Parquet partitions per training process", to_int_or_none
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
    compressSparseCols = make_param(
        "compressSparseCols",
        "store mostly-zero vector columns sparsely in the prepared data",
        TypeConverters.toBoolean,
    )
    dropInvalidRows = make_param(
        "dropInvalidRows",
        "drop rows with a null or NaN feature or label value when preparing the data (default "
        "False: such rows fail the fit, naming the column and count)",
        TypeConverters.toBoolean,
    )
    data = make_param(
        "data",
        "where the ranks read the DataFrame from: 'parquet' (default: a prepared copy in the "
        "store) or 'stream' (the training stage reads the DataFrame itself, no copy)",
        TypeConverters.toString,
    )
    _defaults: ClassVar[dict[str, object]] = {
        "data": "parquet",
        "dropInvalidRows": False,
        "sampleWeightCol": None,
        "labelShapes": None,
        "validation": None,
        "batchSize": 32,
        "valBatchSize": None,
        "trainStepsPerEpoch": None,
        "validationStepsPerEpoch": None,
        "shuffle": True,
        "shuffleBufferSize": None,
        "randomSeed": None,
        "transformationFn": None,
        "inmemoryCacheAll": False,
        "partitionsPerProcess": None,
        "trainReaderNumWorkers": 2,
        "valReaderNumWorkers": 2,
        "reader": "arrow",
        "compressSparseCols": False,
    }

    def getSampleWeightCol(self) -> str | None:
        """Gets the value of ``sampleWeightCol`` or its default value."""
        return self.getOrDefault(self.sampleWeightCol)

    def getLabelShapes(self) -> list[list[int] | None] | None:
        """Gets the value of ``labelShapes`` or its default value."""
        return self.getOrDefault(self.labelShapes)

    def getValidation(self) -> float | str | None:
        """Gets the value of ``validation`` or its default value."""
        return self.getOrDefault(self.validation)

    def getBatchSize(self) -> int:
        """Gets the value of ``batchSize`` or its default value."""
        return self.getOrDefault(self.batchSize)

    def getValBatchSize(self) -> int | None:
        """Gets the value of ``valBatchSize`` or its default value."""
        return self.getOrDefault(self.valBatchSize)

    def getTrainStepsPerEpoch(self) -> int | None:
        """Gets the value of ``trainStepsPerEpoch`` or its default value."""
        return self.getOrDefault(self.trainStepsPerEpoch)

    def getValidationStepsPerEpoch(self) -> int | None:
        """Gets the value of ``validationStepsPerEpoch`` or its default value."""
        return self.getOrDefault(self.validationStepsPerEpoch)

    def getShuffle(self) -> bool:
        """Gets the value of ``shuffle`` or its default value."""
        return self.getOrDefault(self.shuffle)

    def getShuffleBufferSize(self) -> int | None:
        """Gets the value of ``shuffleBufferSize`` or its default value."""
        return self.getOrDefault(self.shuffleBufferSize)

    def getRandomSeed(self) -> int | None:
        """Gets the value of ``randomSeed`` or its default value."""
        return self.getOrDefault(self.randomSeed)

    def getTransformationFn(self) -> Callable[..., object] | None:
        """Gets the value of ``transformationFn`` or its default value."""
        return self.getOrDefault(self.transformationFn)

    def getInmemoryCacheAll(self) -> bool:
        """Gets the value of ``inmemoryCacheAll`` or its default value."""
        return self.getOrDefault(self.inmemoryCacheAll)

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

    def getCompressSparseCols(self) -> bool:
        """Gets the value of ``compressSparseCols`` or its default value."""
        return self.getOrDefault(self.compressSparseCols)


class TrainingParams(DeclaredParams):
    """The training loop every framework shares: model, epochs, callbacks, accumulation, lr."""

    model = make_param("model", "the model to train")
    callbacks = make_param("callbacks", "training callbacks")
    epochs = make_param("epochs", "number of epochs", TypeConverters.toInt)
    backwardPassesPerStep = make_param(
        "backwardPassesPerStep", "local gradient accumulation steps", TypeConverters.toInt
    )
    scaleLr = make_param(
        "scaleLr", "multiply the learning rate by the number of ranks", TypeConverters.toBoolean
    )
    averageRunningStats = make_param(
        "averageRunningStats",
        "at the end of training, average normalisation running statistics (BatchNorm running "
        "mean and variance) over the ranks; False returns rank 0's, as horovod does",
        TypeConverters.toBoolean,
    )
    _defaults: ClassVar[dict[str, object]] = {
        "model": None,
        "callbacks": None,
        "epochs": 1,
        "backwardPassesPerStep": 1,
        "scaleLr": True,
        "averageRunningStats": False,
    }

    def getModel(self) -> Any:
        """Gets the value of ``model`` or its default value."""
        return self.getOrDefault(self.model)

    def getCallbacks(self) -> object:
        """Gets the value of ``callbacks`` or its default value."""
        return self.getOrDefault(self.callbacks)

    def getEpochs(self) -> int:
        """Gets the value of ``epochs`` or its default value."""
        return self.getOrDefault(self.epochs)

    def getBackwardPassesPerStep(self) -> int:
        """Gets the value of ``backwardPassesPerStep`` or its default value."""
        return self.getOrDefault(self.backwardPassesPerStep)

    def getScaleLr(self) -> bool:
        """Gets the value of ``scaleLr`` or its default value."""
        return self.getOrDefault(self.scaleLr)

    def getAverageRunningStats(self) -> bool:
        """Gets the value of ``averageRunningStats`` or its default value."""
        return self.getOrDefault(self.averageRunningStats)


class HorovodCompatParams(DeclaredParams):
    """horovod/petastorm keywords: petastorm's with reader='petastorm', else only defaults.

    See :data:`~spark_estimators.core.params.compat.UNSUPPORTED`.
    """

    readerPoolType = make_param(
        "readerPoolType",
        "petastorm worker pool with reader='petastorm': 'thread', 'process' or 'dummy'; the "
        "default reader takes only 'thread' (its own threads)",
    )
    mpStartMethod = make_param(
        "mpStartMethod", "horovod compatibility: only None (no multiprocessing pool is used)"
    )
    transformationEditFields = make_param(
        "transformationEditFields",
        "reader='petastorm': TransformSpec edit_fields of transformation_fn, tuples (name, numpy "
        "dtype, shape, nullable); the default reader needs none (only None)",
    )
    transformationRemovedFields = make_param(
        "transformationRemovedFields",
        "reader='petastorm': TransformSpec removed_fields of transformation_fn; the default "
        "reader needs none (only None)",
    )
    _defaults: ClassVar[dict[str, object]] = {
        "readerPoolType": "thread",
        "mpStartMethod": None,
        "transformationEditFields": None,
        "transformationRemovedFields": None,
    }

    def getReaderPoolType(self) -> str:
        """Gets the value of ``readerPoolType`` or its default value."""
        return self.getOrDefault(self.readerPoolType) or "thread"

    def getTransformationEditFields(self) -> list[object] | None:
        """Gets the value of ``transformationEditFields`` or its default value."""
        return self.getOrDefault(self.transformationEditFields)

    def getTransformationRemovedFields(self) -> list[str] | None:
        """Gets the value of ``transformationRemovedFields`` or its default value."""
        return self.getOrDefault(self.transformationRemovedFields)


class EstimatorParams(
    LaunchParams,
    HasFeatureCols,
    HasLabelCols,
    HasInputShapes,
    DataParams,
    TrainingParams,
    HasTransformBatchSize,
    HorovodCompatParams,
    HasOutputCols,
):
    """Params common to every estimator (horovod.spark parity plus our additions)."""

    _defaults: ClassVar[dict[str, object]] = {"outputCols": []}

    # horovod's spellings of a few accessors
    def getShufflingBufferSize(self) -> int | None:
        """Horovod's spelling of :meth:`getShuffleBufferSize`."""
        return self.getShuffleBufferSize()

    def setShufflingBufferSize(self, value: int | None) -> Self:
        """Sets the value of ``shuffleBufferSize``."""
        return self._set(shuffleBufferSize=value)

    def getTrainReaderNumWorker(self) -> int:
        """Horovod's spelling of :meth:`getTrainReaderNumWorkers`."""
        return self.getTrainReaderNumWorkers()

    def setTrainReaderNumWorker(self, value: int) -> Self:
        """Sets the value of ``trainReaderNumWorkers``."""
        return self._set(trainReaderNumWorkers=value)

    def getValReaderNumWorker(self) -> int:
        """Horovod's spelling of :meth:`getValReaderNumWorkers`."""
        return self.getValReaderNumWorkers()

    def setValReaderNumWorker(self, value: int) -> Self:
        """Sets the value of ``valReaderNumWorkers``."""
        return self._set(valReaderNumWorkers=value)

    def getInMemoryCacheAll(self) -> bool:
        """Horovod's spelling of :meth:`getInmemoryCacheAll`."""
        return self.getInmemoryCacheAll()

    def setInMemoryCacheAll(self, value: bool) -> Self:
        """Sets the value of ``inmemoryCacheAll``."""
        return self._set(inmemoryCacheAll=value)
