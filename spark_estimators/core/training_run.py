"""One fit from start to end: :class:`TrainingRun`.

``est.fit(df)`` (pyspark's ``Estimator.fit``) calls ``SparkEstimator._fit``, which makes a
TrainingRun of the estimator and its :class:`~spark_estimators.core.framework.Framework` (torch,
keras or lightning) and calls :meth:`TrainingRun.fit`. Everything a fit does then is in this
file, in this order (each step is a method below, in the same order):

1. checks: the DataFrame, every Param (``est._validate_params``), the store is writable, the
   cluster has the task slots, the run id is this fit's alone (``store.lock.hold_run``);
2. data: Parquet in the store (``data.prepare_data``, reused when its cache key matches) or, with
   ``data="stream"``, the DataFrame the training stage reads itself (``data.stream``); with
   ``data="parquet+stream"`` both: the stage reads the DataFrame and writes the Parquet copy,
   published after the launch succeeded (``data.stream_copy``);
   :meth:`TrainingRun.fit_on_parquet` starts from a dataset already in the store instead;
3. spec: the picklable TrainSpec of every rank: the fields every framework shares (built here
   once), the start epoch and history of ``checkpoint.json`` (hot start), the framework's own
   fields; then the framework runs the model on a few rows in the driver;
4. launch: ``backend.run(framework.trainer(), (spec,))``: the ranks on Spark tasks, with the
   epoch lines printed as rank 0 reports them;
5. relaunch: with ``elastic=True`` a failed attempt starts again from the last checkpoint, at
   most ``reset_limit`` times (``core/relaunch.py`` picks the next attempt's number of ranks);
6. result: the framework's Model from the ranks' results; MLflow logging when asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, TypeVar

from spark_estimators._base.console_bar import SPARK_CONSOLE_BAR
from spark_estimators._base.pickling import dumps_by_value
from spark_estimators.core import checks
from spark_estimators.core.backend import Backend, SparkBackend
from spark_estimators.core.checkpoint import read_info, start_fields
from spark_estimators.core.estimator import listify
from spark_estimators.core.progress import EpochProgress
from spark_estimators.core.spec import TrainSpec
from spark_estimators.core.tracking import MlflowTracker
from spark_estimators.data import load_dataset_metadata, prepare_data
from spark_estimators.data.stream import StreamMetadata, prepare_stream
from spark_estimators.data.stream_copy import copy_key, plan_stream_copy, published_copy
from spark_estimators.errors import ConfigurationError, TrainingFailedError
from spark_estimators.store.lock import hold_run
from spark_estimators.task import spare

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_estimators.core.estimator import SparkEstimator
    from spark_estimators.core.framework import FitData, Framework, RankResult
    from spark_estimators.core.model import SparkModel
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.store.base import Store

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound="SparkModel")

__all__ = ["TrainingRun", "wrap_model"]


class TrainingRun:
    """One fit of ``est`` with its ``framework``: checks, data, spec, launch, relaunch, Model.

    Parameters
    ----------
    est : SparkEstimator
        The estimator whose Params the fit reads (not changed, but for the default store).
    framework : Framework
        What only torch, keras or lightning knows (see :mod:`spark_estimators.core.framework`).
    """

    def __init__(self, est: SparkEstimator, framework: Framework) -> None:
        self.est = est
        self.framework = framework
        #: Milliseconds of the last driver-side model check (0: skipped).
        self.preflight_ms = 0.0

    # -- the two ways in -------------------------------------------------------------------------
    def fit(self, df: DataFrame) -> SparkModel:
        """Check, prepare (or stream) ``df``, train and return the Model."""
        est = self.est
        checks.check_dataframe(df, type(est).__name__)
        checks.check_session_active(df, type(est).__name__)
        est._validate_params(list(df.columns))
        store = est._store()
        self._preflight(store)
        with (
            self._hold_run(store),
            checks.explain_null_vectors(df, est.getFeatureCols() + est.getLabelCols()),
            SPARK_CONSOLE_BAR.muted(),  # no stage bar between a fit's lines (issue 27)
        ):
            mode = est.getOrDefault("data")
            if mode == "stream":  # no Parquet copy: the ranks read df
                return self._train(self._stream(df), store)
            if mode == "parquet+stream":  # the ranks read df while its tasks write the copy
                return self._train(self._stream_with_copy(df, store), store)
            return self._train(self._prepare(df, store), store)

    def fit_on_parquet(self, dataset_idx: str | None = None) -> SparkModel:
        """Check, then train on a dataset already in the store (see ``fit_on_parquet``)."""
        self.est._validate_params(None)
        store = self.est._store()
        self._preflight(store)
        with self._hold_run(store):
            return self._train(self._prepared(store, dataset_idx), store)

    # -- 1. checks that need the cluster or the store --------------------------------------------
    def _preflight(self, store: Store) -> None:
        """Before any data is written or job started: the store takes files, the slots exist."""
        store.check_writable()
        self._backend().check_admission()

    def _hold_run(self, store: Store) -> contextlib.AbstractContextManager[object]:
        """Own the given ``run_id`` for the fit (a second live fit on it fails fast).

        A fit without ``run_id`` gets a fresh random one, which nobody else can hold.
        """
        run_id = self.est.getRunId()
        return hold_run(store, run_id) if run_id else contextlib.nullcontext()

    def _num_proc(self) -> int:
        """Ranks: the backend's, else ``num_proc``, else the cluster's default."""
        backend, num_proc = self.est.getBackend(), self.est.getNumProc()
        if backend is not None:
            return int(backend.num_processes())
        return num_proc if num_proc is not None else SparkBackend().num_processes()

    def _backend(self) -> Backend:
        """The user's ``backend``, or a SparkBackend from the Params (and the framework's env)."""
        backend: Backend | None = self.est.getBackend()
        if backend is not None:
            return backend
        est = self.est
        return SparkBackend(
            num_proc=self._num_proc(),
            env=self.framework.rank_env(),
            verbose=est.getVerbose(),
            start_timeout=est.getStartTimeout(),
            use_gpu=est.getUseGpu(),
            collective_backend=est.getCollectiveBackend(),
        )

    # -- 2. data ---------------------------------------------------------------------------------
    def _prepare(self, df: DataFrame, store: Store) -> DatasetMetadata:
        """``df`` as Parquet in the store (Spark jobs on the executors; reused when cached)."""
        est = self.est
        return prepare_data(
            self._num_proc(),
            store,
            df,
            feature_cols=est.getFeatureCols(),
            label_cols=est.getLabelCols(),
            validation=est.getValidation(),
            sample_weight_col=est.getSampleWeightCol(),
            compress_sparse=est.getCompressSparseCols(),
            drop_invalid_rows=est.getOrDefault("dropInvalidRows"),
            partitions_per_process=est.getPartitionsPerProcess(),
            verbose=est.getVerbose(),
            check_columns=est._check_data_shapes,
            rank_imports=spare.PREIMPORTS.get(self.framework.name, ()),
        )

    def _stream(self, df: DataFrame) -> StreamMetadata:
        """``data="stream"``: the training stage's input (no job unless shapes need one)."""
        est = self.est
        source, meta = prepare_stream(
            self._num_proc(),
            df,
            feature_cols=est.getFeatureCols(),
            label_cols=est.getLabelCols(),
            validation=est.getValidation(),
            sample_weight_col=est.getSampleWeightCol(),
            check_columns=est._check_data_shapes,
        )
        meta.source = source  # the driver's DataFrame for the launch (never pickled)
        return meta

    def _stream_with_copy(self, df: DataFrame, store: Store) -> FitData:
        """``data="parquet+stream"``: the stream and the copy its tasks write.

        When the store has the copy already (``prepare_data``'s cache key), the fit reads it as
        ``data="parquet"`` does, with no job before training: there is nothing to write.
        """
        est = self.est
        key = copy_key(
            self._num_proc(),
            store,
            df,
            est.getFeatureCols(),
            est.getLabelCols(),
            est.getValidation(),
            est.getSampleWeightCol(),
        )
        if published_copy(store, key[0]) is not None:
            return self._prepare(df, store)  # finds it (and logs so), as data="parquet" would
        meta = self._stream(df)
        source = meta.source
        columns = list(meta.columns.values())
        copy = plan_stream_copy(
            self._num_proc(), store, columns, meta.has_val, key, source.kept_partitions
        )
        meta.source = dataclasses.replace(source, copy_target=copy)
        return meta

    def _prepared(self, store: Store, dataset_idx: str | None) -> DatasetMetadata:
        """A prepared dataset of the store; else Parquet anyone wrote at its train/val paths."""
        est = self.est
        meta = load_dataset_metadata(
            store,
            dataset_idx,
            feature_cols=est.getFeatureCols(),
            label_cols=est.getLabelCols(),
            sample_weight_col=est.getSampleWeightCol(),
        )
        missing = [c for c in est.getFeatureCols() + est.getLabelCols() if c not in meta.columns]
        if missing:
            raise ConfigurationError(
                f"column(s) {missing!r} are not in the prepared dataset "
                f"{meta.dataset_idx!r}, which has {sorted(meta.columns)!r}"
            )
        est._check_data_shapes(meta.columns)
        return meta

    # -- 3. to 6.: spec, launch, relaunch, Model -------------------------------------------------
    def _train(self, data: FitData, store: Store) -> SparkModel:
        """Launch the ranks (relaunching an elastic fit), then the Model; MLflow around both."""
        run_id = self.est.getRunId() or f"run_{uuid.uuid4().hex[:12]}"
        tracker = MlflowTracker.for_fit(self.est, run_id)  # None unless MLflow logging applies
        try:
            results = self._launch(data, store, run_id, tracker)
            model = self.framework.build_model(results, run_id)
            if tracker is not None:
                try:
                    tracker.log_model(self.est, model, data, store, self.framework.name)
                except Exception as exc:  # noqa: BLE001 - the fit itself succeeded
                    logger.warning("the trained model could not be logged to MLflow: %r", exc)
        except BaseException:
            if tracker is not None:
                tracker.end(failed=True)
            raise
        if tracker is not None:
            tracker.end()
        return model

    def _launch(
        self, data: FitData, store: Store, run_id: str, tracker: MlflowTracker | None
    ) -> list[RankResult]:
        """The ranks' results; a failed ``data="parquet+stream"`` fit removes its copy's files."""
        source = data.source if isinstance(data, StreamMetadata) else None
        copy = getattr(source, "copy_target", None)
        try:
            return self._launch_attempts(data, store, run_id, tracker)
        except BaseException:
            if copy is not None:
                copy.discard()
            raise

    def _launch_attempts(
        self, data: FitData, store: Store, run_id: str, tracker: MlflowTracker | None
    ) -> list[RankResult]:
        """The ranks' results; an elastic fit relaunches a failed attempt from its checkpoint."""
        est = self.est
        backend = self._backend()
        trainer = spare.with_preimports(self.framework.trainer(), self.framework.name)
        stream = {"stream_input": data.source} if isinstance(data, StreamMetadata) else {}
        failures: list[TrainingFailedError] = []
        while True:
            spec = self.spec(data, store, run_id, backend.num_processes())
            progress = EpochProgress(
                est.getEpochs(),
                est.getVerbose(),
                spec.start_epoch,
                run_id=run_id,
                on_epoch=None if tracker is None else tracker.log_epoch,
            )
            try:
                return backend.run(trainer, (spec,), event_callback=progress, **stream)
            except TrainingFailedError as exc:
                if not est.getElastic():
                    raise
                failures.append(exc)
                if len(failures) > est.getResetLimit():
                    raise est._reset_limit_error(failures) from exc
                backend = est._relaunch_backend(backend, exc, len(failures))
            finally:
                progress.close()

    def spec(self, data: FitData, store: Store, run_id: str, num_proc: int) -> TrainSpec:
        """The TrainSpec of one attempt on ``num_proc`` ranks, checked in the driver.

        The shared fields are built here, once for every framework: the user's objects pickled
        by value (``Framework.shipped``), the store's view for the ranks, columns, batch sizes
        (capped to the rows a rank has), reader options, and where ``checkpoint.json`` says the
        run stands (start epoch and history; a fresh run starts at 0).
        """
        est, framework = self.est, self.framework
        info = read_info(store, run_id, framework.name)
        user, roots = framework.shipped()
        # Params every estimator has: the modules of their objects travel for every framework.
        roots = [*roots, *listify(est.getCallbacks()), est.getTransformationFn()]
        try:
            blob = dumps_by_value(user, roots=[r for r in roots if r not in (None, False)])
        except Exception as exc:
            raise checks.unpicklable_error(getattr(user, "__dict__", {"user": user}), exc) from exc
        batch = checks.cap_batch_size(est.getBatchSize(), data.train_rows, num_proc)
        val_batch = est.getValBatchSize() or est.getBatchSize()
        val_batch = checks.cap_batch_size(val_batch, data.val_rows, num_proc, "val_batch_size")
        shared = TrainSpec(
            user_blob=blob,
            store=store.to_remote(run_id),
            meta=data,  # type: ignore[arg-type]  # a StreamMetadata stands in for a dataset
            run_id=run_id,
            feature_cols=est.getFeatureCols(),
            label_cols=est.getLabelCols(),
            sample_weight_col=est.getSampleWeightCol(),
            input_shapes=est.getInputShapes(),
            label_shapes=est.getLabelShapes(),
            batch_size=batch,
            val_batch_size=val_batch,
            epochs=est.getEpochs(),
            train_steps_per_epoch=est.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=est.getValidationStepsPerEpoch(),
            shuffle=est.getShuffle(),
            seed=est.getRandomSeed(),
            inmemory_cache_all=est.getInmemoryCacheAll(),
            use_gpu=est.getUseGpu(),
            reader=est.getReader(),
            train_reader_num_workers=est.getTrainReaderNumWorkers(),
            val_reader_num_workers=est.getValReaderNumWorkers(),
            shuffle_buffer_size=est.getShuffleBufferSize(),
            average_running_stats=est.getAverageRunningStats(),
            reader_pool_type=est.getReaderPoolType(),
            transformation_edit_fields=est.getTransformationEditFields(),
            transformation_removed_fields=est.getTransformationRemovedFields(),
            **start_fields(info),
        )
        spec = framework.build_spec(shared, data, store, info)
        # The common first-fit mistakes fail here, in the driver, with the fix first.
        self.preflight_ms = framework.check_spec(spec, store, data)
        if self.preflight_ms:
            logger.debug("the driver-side model check took %.0f ms", self.preflight_ms)
        return spec


def wrap_model(
    est: SparkEstimator,
    model_cls: type[ModelT],
    model: object,
    results: list[RankResult],
    run_id: str,
    **extra: object,
) -> ModelT:
    """The fitted Model: ``model`` with rank 0's history and output shapes, ``est``'s columns."""
    first = results[0]
    fitted = model_cls(
        model=model,
        history=first["history"],
        run_id=run_id,
        output_shapes=first["output_shapes"],
        featureCols=est.getFeatureCols(),
        labelCols=est.getLabelCols(),
        inputShapes=est.getInputShapes(),
        transformBatchSize=est.getTransformBatchSize(),
        **extra,
    )
    if est.getOutputCols():
        fitted.setOutputCols(est.getOutputCols())
    return fitted
