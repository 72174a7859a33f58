"""The estimator base class: validate -> prepare_data (cached) -> launch through a Backend -> Model.

Framework estimators (torch, lightning, keras) subclass :class:`SparkEstimator` and provide
``_validate_framework``, ``_remote_trainer`` (a module-level function run on every rank with one
picklable spec argument) and ``_create_model``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import uuid
from typing import Any

from pyspark.ml import Estimator

from spark_estimators._base.console_bar import SPARK_CONSOLE_BAR
from spark_estimators.core import checks
from spark_estimators.core.backend import Backend, SparkBackend
from spark_estimators.core.checkpoint import CheckpointInfo, start_fields
from spark_estimators.core.params import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    EstimatorParams,
    KeywordParams,
    check_unsupported,
)
from spark_estimators.core.params.base import keyword_only
from spark_estimators.core.persistence import PersistenceMixin
from spark_estimators.core.progress import EpochProgress
from spark_estimators.core.relaunch import ElasticRelaunch
from spark_estimators.core.tracking import MlflowTracker, check_available
from spark_estimators.envvars import BACKEND_NAMES as COLLECTIVE_BACKENDS
from spark_estimators.errors import (
    ConfigurationError,
    TrainingFailedError,
)
from spark_estimators.task import spare

logger = logging.getLogger(__name__)

__all__ = ["HOROVOD_DATA_MODULE_KEYWORDS", "SparkEstimator", "listify"]

READERS = ("arrow", "petastorm")


def listify(value: Any) -> list[Any]:
    """``value`` as a list: None -> [], a list or tuple -> its items, anything else -> [value]."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _bad(param: str, value: Any, expected: str, fix: str = "") -> ConfigurationError:
    msg = f"{param}={value!r} is invalid: expected {expected}"
    return ConfigurationError(msg + (f". {fix}" if fix else ""))


class SparkEstimator(PersistenceMixin, Estimator, ElasticRelaunch, KeywordParams, EstimatorParams):
    """Base of every spark_estimators estimator (see the framework subclasses).

    A subclass composes the Params mixins its framework uses (see
    :mod:`spark_estimators.core.params`), defines a keyword-only ``__init__`` decorated with
    ``@keyword_only`` that passes ``self._input_kwargs`` on, and calls
    :func:`~spark_estimators.core.params.document_constructor` for its ``Parameters`` docs.
    """

    _framework = "base"
    _input_kwargs: dict[str, Any]  # set by @keyword_only: the keywords the caller passed

    @keyword_only
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.setParams(**kwargs)

    def _dropped_param(self, name: str, value: Any) -> None:
        """A Param of a stage saved by an older version that this estimator no longer has.

        Its "not used" value (the only one such a stage could train with) is dropped; any other
        value is refused like the keyword itself (see ``_not_taken``), naming the alternative.
        """
        self._refuse_keyword(name, value)

    def copy(self, extra: Any = None) -> SparkEstimator:
        """A copy with ``extra`` params set; models and optimizers in params are shared."""
        # Params holding models/optimizers are shared, not deep-copied (as pyspark does).
        return super().copy(extra)

    # -- validation ------------------------------------------------------------------------------
    def _validate_params(self, columns: list[str] | None = None) -> None:
        """Check every param in the driver, before any Spark job. ``columns``: the input's."""
        if self.getModel() is None:
            raise ConfigurationError(
                f"{type(self).__name__} needs model=...: pass the model to train"
            )
        checks.check_model_object(self.getModel())
        features, labels = self.getFeatureCols(), self.getLabelCols()
        if not features:
            raise _bad("feature_cols", features, "a non-empty list of column names")
        if not labels:
            raise _bad("label_cols", labels, "a non-empty list of column names")
        num_proc = self.getNumProc()
        if num_proc is not None and (isinstance(num_proc, bool) or num_proc < 1):
            raise _bad("num_proc", num_proc, "a positive int (or None for the default)")
        for name, value in (("batch_size", self.getBatchSize()), ("epochs", self.getEpochs())):
            if value < 1:
                raise _bad(name, value, "an int >= 1")
        if self.getEpochs() < 1:
            raise _bad("epochs", self.getEpochs(), "an int >= 1")
        val_bs = self.getValBatchSize()
        if val_bs is not None and val_bs < 1:
            raise _bad("val_batch_size", val_bs, "an int >= 1 or None")
        for name in ("trainStepsPerEpoch", "validationStepsPerEpoch"):
            steps = self.getOrDefault(name)
            if steps is not None and steps < 1:
                raise _bad(name, steps, "an int >= 1 or None (all rows)")
        if self.getBackwardPassesPerStep() < 1:
            raise _bad("backward_passes_per_step", self.getBackwardPassesPerStep(), "an int >= 1")
        if self.getReader() not in READERS:
            raise _bad("reader", self.getReader(), f"one of {READERS}")
        if self.getCollectiveBackend() not in COLLECTIVE_BACKENDS:
            raise _bad(
                "collective_backend", self.getCollectiveBackend(), f"one of {COLLECTIVE_BACKENDS}"
            )
        backend = self.getBackend()
        if backend is not None and not isinstance(backend, Backend):
            raise _bad(
                "backend",
                backend,
                "a spark_estimators Backend (e.g. SparkBackend)",
                "Use collective_backend='gloo'|'nccl'|'mpi' to choose the collective.",
            )
        if backend is not None and num_proc is not None and backend.num_processes() != num_proc:
            raise ConfigurationError(
                f"num_proc={num_proc} conflicts with backend.num_processes()="
                f"{backend.num_processes()}: set one of them"
            )
        self._validate_elastic(num_proc)
        from spark_estimators.data.stream import check_data_mode

        check_data_mode(self)
        check_unsupported(self)  # horovod params without an effect here: refused, not ignored
        check_available(self.getOrDefault("logToMlflow"))
        store = self.getStore()
        if store is not None:
            from spark_estimators.store import Store

            if not isinstance(store, Store):
                raise _bad(
                    "store",
                    store,
                    "a spark_estimators Store",
                    "Build one with Store.create('file:///path') or LocalStore(path).",
                )
        validation = self.getValidation()
        if validation is not None and not isinstance(validation, str):
            if isinstance(validation, bool) or not isinstance(validation, int | float):
                raise _bad("validation", validation, "a float in [0, 1) or a column name")
            if not 0 <= float(validation) < 1:
                raise _bad("validation", validation, "a float in [0, 1) or a column name")
        weights = self.getOrDefault("lossWeights") if self.hasParam("lossWeights") else None
        if weights is not None and len(weights) != len(labels):
            raise ConfigurationError(
                f"loss_weights has {len(weights)} entries but there are {len(labels)} label "
                f"columns {labels!r}: give one weight per label"
            )
        shapes = self.getInputShapes()
        if shapes is not None and len(shapes) != len(features):
            raise ConfigurationError(
                f"input_shapes has {len(shapes)} entries but there are {len(features)} feature "
                f"columns {features!r}: give one shape per feature column"
            )
        if columns is not None:
            wanted = list(features) + list(labels)
            weight_col = self.getSampleWeightCol()
            if weight_col:
                wanted.append(weight_col)
            if isinstance(validation, str):
                wanted.append(validation)
            missing = [c for c in wanted if c not in columns]
            if missing:
                raise ConfigurationError(
                    f"column(s) {missing!r} not found in the DataFrame; available columns: "
                    f"{columns!r}. Check feature_cols, label_cols, sample_weight_col, validation."
                )
        self._validate_framework()

    def _validate_elastic(self, num_proc: int | None) -> None:
        elastic = self.getElastic()
        if not isinstance(elastic, bool):
            raise _bad("elastic", elastic, "True or False")
        limit = self.getResetLimit()
        if isinstance(limit, bool) or limit < 0:
            raise _bad("reset_limit", limit, "an int >= 0 (relaunches allowed within one fit)")
        low = self.getMinNumProc()
        if low is None:
            return
        if isinstance(low, bool) or low < 1:
            raise _bad("min_num_proc", low, "a positive int or None (num_proc)")
        if not elastic:
            raise _bad("min_num_proc", low, "None unless elastic=True", "Set elastic=True too.")
        if num_proc is not None and low > num_proc:
            raise ConfigurationError(
                f"min_num_proc={low} is larger than num_proc={num_proc}: a relaunch can only go "
                "on with fewer ranks, never more; lower min_num_proc"
            )

    def _validate_framework(self) -> None:
        """Framework-specific checks (model type, optimizer, loss)."""

    # -- fit -------------------------------------------------------------------------------------
    def _fit(self, df: Any) -> Any:
        checks.check_dataframe(df, type(self).__name__)
        self._validate_params(list(df.columns))
        from spark_estimators.data import prepare_data

        if self.getOrDefault("data") == "stream":  # no Parquet copy: the ranks read df itself
            from spark_estimators.data.stream import fit_streaming

            return fit_streaming(self, df)
        store = self._store()
        self._preflight(store)
        with (
            self._hold_run(store),
            checks.explain_null_vectors(df, self.getFeatureCols() + self.getLabelCols()),
            SPARK_CONSOLE_BAR.muted(),  # no stage bar between a fit's lines (issue 27)
        ):
            meta = prepare_data(
                self._num_proc(),
                store,
                df,
                feature_cols=self.getFeatureCols(),
                label_cols=self.getLabelCols(),
                validation=self.getValidation(),
                sample_weight_col=self.getSampleWeightCol(),
                compress_sparse=self.getCompressSparseCols(),
                drop_invalid_rows=self.getOrDefault("dropInvalidRows"),
                partitions_per_process=self.getPartitionsPerProcess(),
                verbose=self.getVerbose(),
                check_columns=self._check_data_shapes,
                rank_imports=spare.PREIMPORTS.get(self._framework, ()),
            )
            return self._fit_on_prepared(meta)

    def fit_on_parquet(self, params: Any = None, dataset_idx: Any = None) -> Any:
        """Train on a dataset already in the store (from ``prepare_data`` or an earlier fit).

        Parameters
        ----------
        params
            Optional param map applied to a copy of this estimator first.
        dataset_idx
            Which prepared dataset of the store; default the only/most recent one.
        """
        est = self.copy(params) if params else self
        est._validate_params(None)
        est._preflight(est._store())
        with est._hold_run(est._store()):
            return est._fit_on_parquet(dataset_idx)

    def _fit_on_parquet(self, dataset_idx: Any) -> Any:
        est = self
        from spark_estimators.data import load_dataset_metadata

        # Prepared datasets first; else Parquet written by anyone at the store's un-indexed
        # train/val paths (horovod's fit_on_parquet), described from the files themselves.
        meta = load_dataset_metadata(
            est._store(),
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
        return est._fit_on_prepared(meta)

    def _preflight(self, store: Any) -> None:
        """Driver-side checks before any data is written or job started: store and slots."""
        store.check_writable()
        self._launch_backend().check_admission()

    def _check_data_shapes(self, columns: dict[str, Any]) -> None:
        """``input_shapes``/``label_shapes`` against the values per row the data holds."""
        from spark_estimators.core.tensors import check_shapes

        sizes = {name: int(math.prod(info.shape)) for name, info in columns.items()}
        check_shapes("input_shapes", self.getFeatureCols(), self.getInputShapes(), sizes)
        check_shapes("label_shapes", self.getLabelCols(), self.getLabelShapes(), sizes)

    def _hold_run(self, store: Any) -> contextlib.AbstractContextManager[Any]:
        """Own the given ``run_id`` for the fit (a second live fit on it fails fast).

        A fit without ``run_id`` gets a fresh random one, which nobody else can hold.
        """
        run_id = self.getRunId()
        if not run_id:
            return contextlib.nullcontext()
        from spark_estimators.store.lock import hold_run

        return hold_run(store, run_id)

    def _store(self) -> Any:
        store = self.getStore()
        if store is None:
            from spark_estimators.store.local import session_local_store

            store = session_local_store()  # removed when this Python process exits
            self._set(store=store)
            logger.info(
                "no store given: using a LocalStore at %s, removed when Python exits",
                store.prefix_path,
            )
        return store

    def _num_proc(self) -> int:
        backend = self.getBackend()
        if backend is not None:
            return int(backend.num_processes())
        if self.getNumProc() is not None:
            return int(self.getNumProc())  # type: ignore[arg-type]
        return SparkBackend().num_processes()

    def _launch_backend(self) -> Backend:
        backend = self.getBackend()
        if backend is not None:
            return backend
        return SparkBackend(
            num_proc=self._num_proc(),
            verbose=self.getVerbose(),
            start_timeout=self.getStartTimeout(),
            use_gpu=self.getUseGpu(),
            collective_backend=self.getCollectiveBackend(),
        )

    def _fit_on_prepared(self, meta: Any) -> Any:
        run_id = self.getRunId() or f"run_{uuid.uuid4().hex[:12]}"
        store = self._store()
        backend = self._launch_backend()
        tracker = MlflowTracker.for_fit(self, run_id)  # None unless MLflow logging applies
        try:
            model = self._train(meta, store, backend, run_id, tracker)
            if tracker is not None:
                try:
                    tracker.log_model(self, model, meta, store)
                except Exception as exc:  # noqa: BLE001 - the fit itself succeeded
                    logger.warning("the trained model could not be logged to MLflow: %r", exc)
        except BaseException:
            if tracker is not None:
                tracker.end(failed=True)
            raise
        if tracker is not None:
            tracker.end()
        return model

    def _train(self, meta: Any, store: Any, backend: Backend, run_id: str, tracker: Any) -> Any:
        failures: list[TrainingFailedError] = []
        while True:
            spec = self._training_spec(meta, store, run_id, backend.num_processes())
            progress = EpochProgress(
                self.getEpochs(),
                self.getVerbose(),
                spec.start_epoch,
                run_id=run_id,
                on_epoch=None if tracker is None else tracker.log_epoch,
            )
            try:
                stream = {"stream_input": meta.source} if getattr(meta, "source", None) else {}
                trainer = spare.with_preimports(self._remote_trainer(), self._framework)
                results = backend.run(trainer, (spec,), event_callback=progress, **stream)
                break
            except TrainingFailedError as exc:
                if not self.getElastic():
                    raise
                failures.append(exc)
                if len(failures) > self.getResetLimit():
                    raise self._reset_limit_error(failures) from exc
                backend = self._relaunch_backend(backend, exc, len(failures))
            finally:
                progress.close()
        return self._create_model(results, meta, run_id)

    # -- shared pieces of the framework specs ----------------------------------------------------
    def _spec_fields(
        self,
        user: Any,
        roots: list[Any],
        store: Any,
        remote_store: Any,
        meta: Any,
        run_id: str,
        info: CheckpointInfo | None,
    ) -> dict[str, Any]:
        """The :class:`~spark_estimators.core.spec.TrainSpec` fields every framework shares.

        ``user`` is pickled by value together with the modules of ``roots`` (the user's model,
        losses, callbacks, ...); ``info`` is the run's checkpoint info (None: start at epoch 0).
        """
        from spark_estimators._base.pickling import dumps_by_value

        try:
            blob = dumps_by_value(user, roots=[r for r in roots if r not in (None, False)])
        except Exception as exc:
            raise checks.unpicklable_error(getattr(user, "__dict__", {"user": user}), exc) from exc
        num_proc = self._num_proc()
        batch = checks.cap_batch_size(self.getBatchSize(), meta.train_rows, num_proc)
        val_batch = self.getValBatchSize() or self.getBatchSize()
        val_batch = checks.cap_batch_size(val_batch, meta.val_rows, num_proc, "val_batch_size")
        return {
            "user_blob": blob,
            "store": remote_store,
            "meta": meta,
            "run_id": run_id,
            "feature_cols": self.getFeatureCols(),
            "label_cols": self.getLabelCols(),
            "sample_weight_col": self.getSampleWeightCol(),
            "input_shapes": self.getInputShapes(),
            "label_shapes": self.getLabelShapes(),
            "batch_size": batch,
            "val_batch_size": val_batch,
            "epochs": self.getEpochs(),
            "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            "validation_steps_per_epoch": self.getValidationStepsPerEpoch(),
            "shuffle": self.getShuffle(),
            "seed": self.getRandomSeed(),
            "inmemory_cache_all": self.getInmemoryCacheAll(),
            "use_gpu": self.getUseGpu(),
            "reader": self.getReader(),
            "train_reader_num_workers": self.getTrainReaderNumWorkers(),
            "val_reader_num_workers": self.getValReaderNumWorkers(),
            "shuffle_buffer_size": self.getShuffleBufferSize(),
            "average_running_stats": self.getAverageRunningStats(),
            "reader_pool_type": self.getReaderPoolType(),
            "transformation_edit_fields": self.getTransformationEditFields(),
            "transformation_removed_fields": self.getTransformationRemovedFields(),
            **start_fields(info),
        }

    # Every rank must end with the same trainable parameters (see core.checks).
    _check_fingerprints = staticmethod(checks.check_fingerprints)

    def _model_params(self) -> dict[str, Any]:
        """Params every fitted model copies from its estimator."""
        return {
            "featureCols": self.getFeatureCols(),
            "labelCols": self.getLabelCols(),
            "inputShapes": self.getInputShapes(),
            "transformBatchSize": self.getTransformBatchSize(),
        }

    def _trained_module(self, results: list[Any]) -> Any:
        """A CPU copy of the user's torch module with rank 0's final weights, in eval mode."""
        self._check_fingerprints(results)
        module = copy.deepcopy(self.getModel()).cpu()
        module.load_state_dict(results[0]["state_dict"])
        module.eval()
        return module

    def _wrap_model(
        self, model_cls: type, model: Any, results: list[Any], run_id: str, **extra: Any
    ) -> Any:
        """The fitted Model: ``model`` with rank 0's history and output shapes, our columns."""
        first = results[0]
        fitted = model_cls(
            model=model,
            history=first["history"],
            run_id=run_id,
            output_shapes=first["output_shapes"],
            **extra,
            **self._model_params(),
        )
        if self.getOutputCols():
            fitted.setOutputCols(self.getOutputCols())
        return fitted

    # -- framework hooks -------------------------------------------------------------------------
    def _training_spec(self, meta: Any, store: Any, run_id: str, num_proc: int) -> Any:
        raise NotImplementedError

    def _remote_trainer(self) -> Any:
        raise NotImplementedError

    def _create_model(self, results: list[Any], meta: Any, run_id: str) -> Any:
        raise NotImplementedError
