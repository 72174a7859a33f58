"""The Params every estimator has, grouped by role, and :class:`EstimatorParams` composing them.

Each group declares its Params with their typed getters (``getX = ParamGetter(doc, converter)``;
``make_param`` where the getter is written out) and their defaults in ``_defaults``; ``setX``
and the missing getters are generated. The supervised Params (optimizer, loss, metrics, ...)
are not here: see :mod:`spark_estimators.core.params.shared`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pyspark.ml.param import TypeConverters
from pyspark.ml.param.shared import HasOutputCols

from spark_estimators.core.params.base import (
    DeclaredParams,
    ParamGetter,
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

    getNumProc = ParamGetter("number of training processes (Spark tasks)", to_int_or_none)
    getBackend: ParamGetter[Backend | None] = ParamGetter(
        "Backend object that launches training (default SparkBackend)"
    )
    getCollectiveBackend = ParamGetter(
        "collective backend: auto, gloo, nccl, mpi", TypeConverters.toString
    )
    getStore: ParamGetter[Store | None] = ParamGetter(
        "Store for intermediate data, checkpoints and logs"
    )
    getUseGpu: ParamGetter[bool | None] = ParamGetter(
        "train on the task's GPU when one is assigned"
    )
    getStartTimeout = ParamGetter("seconds for all tasks to start", TypeConverters.toFloat)
    getVerbose = ParamGetter("0 quiet, 1 progress bar and epoch lines", TypeConverters.toInt)
    getRunId = ParamGetter("id of the run in the store; reuse it to hot-start", to_str_or_none)
    getElastic = ParamGetter(
        "when a rank fails, relaunch the training within the same fit from the last checkpoint",
        TypeConverters.toBoolean,
    )
    getMinNumProc = ParamGetter(
        "elastic: fewest ranks a relaunch may go on with when slots are missing (default numProc)",
        to_int_or_none,
    )
    getResetLimit = ParamGetter("elastic: most relaunches within one fit", TypeConverters.toInt)
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


class DataParams(DeclaredParams):
    """What the ranks read: columns, validation split, batches, the reader and its shuffling."""

    getSampleWeightCol = ParamGetter("column of per-row loss weights", to_str_or_none)
    getLabelShapes: ParamGetter[list[list[int] | None] | None] = ParamGetter(
        "shape of each label, without the batch dim"
    )
    getValidation: ParamGetter[float | str | None] = ParamGetter(
        "fraction of rows or a column name marking validation rows"
    )
    getBatchSize = ParamGetter("rows per batch and rank", TypeConverters.toInt)
    getValBatchSize = ParamGetter("validation rows per batch and rank", to_int_or_none)
    getTrainStepsPerEpoch = ParamGetter("steps per epoch (None: all)", to_int_or_none)
    getValidationStepsPerEpoch = ParamGetter(
        "validation steps per epoch (None: all)", to_int_or_none
    )
    getShuffle = ParamGetter("shuffle the training data every epoch", TypeConverters.toBoolean)
    getShuffleBufferSize = ParamGetter(
        "rows of the reader's shuffle buffer (None: automatic; 0: no shuffling)",
        to_int_or_none,
    )
    getRandomSeed = ParamGetter("seed for shuffling and model init", to_int_or_none)
    getTransformationFn: ParamGetter[Callable[..., object] | None] = ParamGetter(
        "fn(pandas.DataFrame) applied to each batch"
    )
    getInmemoryCacheAll = ParamGetter("keep each rank's shard in memory", TypeConverters.toBoolean)
    getPartitionsPerProcess = ParamGetter("Parquet partitions per training process", to_int_or_none)
    getTrainReaderNumWorkers = ParamGetter("reader threads for training data", TypeConverters.toInt)
    getValReaderNumWorkers = ParamGetter("reader threads for validation data", TypeConverters.toInt)
    getReader = ParamGetter(
        "data reader: 'arrow' (default) or 'petastorm'", TypeConverters.toString
    )
    getCompressSparseCols = ParamGetter(
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
        "store), 'stream' (the training stage reads the DataFrame itself, no copy) or "
        "'parquet+stream' (the ranks read the stream while its tasks write the copy, which "
        "later fits reuse)",
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


class TrainingParams(DeclaredParams):
    """The training loop every framework shares: model, epochs, callbacks, accumulation, lr."""

    getModel: ParamGetter[Any] = ParamGetter("the model to train")
    getCallbacks: ParamGetter[object] = ParamGetter("training callbacks")
    getEpochs = ParamGetter("number of epochs", TypeConverters.toInt)
    getBackwardPassesPerStep = ParamGetter(
        "local gradient accumulation steps", TypeConverters.toInt
    )
    getScaleLr = ParamGetter(
        "multiply the learning rate by the number of ranks", TypeConverters.toBoolean
    )
    getAverageRunningStats = ParamGetter(
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
    getTransformationEditFields: ParamGetter[list[object] | None] = ParamGetter(
        "reader='petastorm': TransformSpec edit_fields of transformation_fn, tuples (name, numpy "
        "dtype, shape, nullable); the default reader needs none (only None)",
    )
    getTransformationRemovedFields: ParamGetter[list[str] | None] = ParamGetter(
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
