"""The estimator base class: Params, their checks, and the entry points of a fit.

A fit itself is a :class:`~spark_estimators.core.training_run.TrainingRun` (read it top to
bottom in ``core/training_run.py``). Framework estimators (torch, lightning, keras) subclass
:class:`SparkEstimator`, add their checks in ``_validate_framework`` and return their
``TrainingRun(self, <Framework>)`` from ``_training_run`` (see ``core/framework.py``).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, TypeAlias, cast, overload

from pyspark.ml import Estimator

from spark_estimators.core import checks
from spark_estimators.core.backend import Backend
from spark_estimators.core.params import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    EstimatorParams,
    KeywordParams,
    check_unsupported,
)
from spark_estimators.core.params.base import keyword_only
from spark_estimators.core.persistence import PersistenceMixin
from spark_estimators.core.relaunch import ElasticRelaunch
from spark_estimators.core.tensors import check_shapes
from spark_estimators.core.tracking import check_available
from spark_estimators.data.stream import check_data_mode
from spark_estimators.envvars import BACKEND_NAMES as COLLECTIVE_BACKENDS
from spark_estimators.errors import ConfigurationError, did_you_mean
from spark_estimators.store import Store
from spark_estimators.store.local import session_local_store

if TYPE_CHECKING:
    from pyspark.ml.param import Param
    from pyspark.sql import DataFrame

    from spark_estimators.core.framework import Fit
    from spark_estimators.core.model import SparkModel
    from spark_estimators.data.metadata import ColumnInfo

    # pyspark's ParamMap lives in its type stubs only (pyspark.ml._typing), which the API
    # reference's TYPE_CHECKING pass cannot import.
    ParamMap: TypeAlias = dict[Param[Any], Any]

logger = logging.getLogger(__name__)

__all__ = ["HOROVOD_DATA_MODULE_KEYWORDS", "SparkEstimator", "listify"]

READERS = ("arrow", "petastorm")


def listify(value: object) -> list[Any]:
    """``value`` as a list: None -> [], a list or tuple -> its items, anything else -> [value]."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _bad(param: str, value: object, expected: str, fix: str = "") -> ConfigurationError:
    msg = f"{param}={value!r} is invalid: expected {expected}"
    return ConfigurationError(msg + (f". {fix}" if fix else ""))


def _check_kind(param: str, value: object, kind: type, expected: str, fix: str) -> None:
    """Refuse ``value`` (a Param's) unless it is None or a ``kind``."""
    if value is not None and not isinstance(value, kind):
        raise _bad(param, value, expected, fix)


class SparkEstimator(PersistenceMixin, Estimator, ElasticRelaunch, KeywordParams, EstimatorParams):
    """Base of every spark_estimators estimator (see the framework subclasses).

    A subclass composes the Params mixins its framework uses (see
    :mod:`spark_estimators.core.params`), defines a keyword-only ``__init__`` decorated with
    ``@keyword_only`` that passes ``self._input_kwargs`` on, and calls
    :func:`~spark_estimators.core.params.document_constructor` for its ``Parameters`` docs.
    """

    _input_kwargs: dict[str, Any]  # set by @keyword_only: the keywords the caller passed

    @keyword_only
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.setParams(**kwargs)

    def _dropped_param(self, name: str, value: object) -> None:
        """A Param of a stage saved by an older version that this estimator no longer has.

        Its "not used" value (the only one such a stage could train with) is dropped; any other
        value is refused like the keyword itself (see ``_not_taken``), naming the alternative.
        """
        self._refuse_keyword(name, value)

    def copy(self, extra: ParamMap | None = None) -> SparkEstimator:
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
        _check_kind(
            "backend",
            backend,
            Backend,
            "a spark_estimators Backend (e.g. SparkBackend)",
            "Use collective_backend='gloo'|'nccl'|'mpi' to choose the collective.",
        )
        if backend is not None and num_proc is not None and backend.num_processes() != num_proc:
            raise ConfigurationError(
                f"num_proc={num_proc} conflicts with backend.num_processes()="
                f"{backend.num_processes()}: set one of them"
            )
        self._validate_elastic(num_proc)
        check_data_mode(self)
        check_unsupported(self)  # horovod params without an effect here: refused, not ignored
        check_available(self.getOrDefault("logToMlflow"))
        _check_kind(
            "store",
            self.getStore(),
            Store,
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
        # A dict (Keras's named outputs) is checked against the model's output names by the
        # framework's _validate_framework.
        if isinstance(weights, list) and len(weights) != len(labels):
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
            missing = [c for c in self._input_columns() if c not in columns]
            if missing:
                raise ConfigurationError(
                    f"column(s) {missing!r} not found in the DataFrame"
                    f"{did_you_mean(missing, columns)}; available columns: {columns!r}. "
                    "Check feature_cols, label_cols, sample_weight_col, validation."
                )
        self._validate_framework()

    def _input_columns(self) -> list[str]:
        """The columns a fit reads: features, labels, the sample weights, a validation flag."""
        weight_col = self.getSampleWeightCol()
        validation = self.getValidation()
        optional = [weight_col] if weight_col else []
        if isinstance(validation, str):
            optional.append(validation)
        return [*self.getFeatureCols(), *self.getLabelCols(), *optional]

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

    # -- fit: one TrainingRun (core/training_run.py) --------------------------------------------
    @overload
    def fit(self, dataset: DataFrame, params: ParamMap | None = ...) -> SparkModel: ...

    @overload
    def fit(
        self, dataset: DataFrame, params: list[ParamMap] | tuple[ParamMap]
    ) -> list[SparkModel]: ...

    def fit(
        self,
        dataset: DataFrame,
        params: ParamMap | list[ParamMap] | tuple[ParamMap] | None = None,
    ) -> SparkModel | list[SparkModel]:
        """Train on ``dataset`` and return the fitted Model (pyspark.ml's ``Estimator.fit``).

        Parameters
        ----------
        dataset : pyspark.sql.DataFrame
            The training data: the feature, label (and weight/validation) columns.
        params : dict or list or tuple, optional
            A param map applied to a copy of this estimator first; a list/tuple of them
            fits one model per map and returns the list.

        Notes
        -----
        The same as pyspark's ``Estimator.fit``, defined here so that MLflow's pyspark.ml
        autologging, which patches ``Estimator.fit``, does not wrap our fit: the fit logs to
        MLflow itself when autologging is on (see :mod:`spark_estimators.core.tracking`).
        """
        if params is None:
            params = {}
        if isinstance(params, list | tuple):
            models: list[SparkModel | None] = [None] * len(params)
            for index, model in self.fitMultiple(dataset, params):
                models[index] = model
            return cast("list[SparkModel]", models)
        if not isinstance(params, dict):
            raise TypeError(
                f"params must be a param map or a list/tuple of param maps, got {type(params)}"
            )
        return self.copy(params)._fit(dataset) if params else self._fit(dataset)

    def _fit(self, df: DataFrame) -> SparkModel:
        return self._training_run().fit(df)

    def fit_on_parquet(
        self, params: ParamMap | None = None, dataset_idx: str | None = None
    ) -> SparkModel:
        """Train on a dataset already in the store (from ``prepare_data`` or an earlier fit).

        Parameters
        ----------
        params
            Optional param map applied to a copy of this estimator first.
        dataset_idx
            Which prepared dataset of the store; default the only/most recent one. Parquet
            written by anyone at the store's un-indexed train/val paths is read too
            (horovod's ``fit_on_parquet``), described from the files themselves.
        """
        est = self.copy(params) if params else self
        return est._training_run().fit_on_parquet(dataset_idx)

    def _training_run(self) -> Fit:
        """``TrainingRun(self, <this framework's Framework>)``: one per fit."""
        raise NotImplementedError

    def _check_data_shapes(self, columns: dict[str, ColumnInfo]) -> None:
        """``input_shapes``/``label_shapes`` against the values per row the data holds."""
        sizes = {name: int(math.prod(info.shape)) for name, info in columns.items()}
        check_shapes("input_shapes", self.getFeatureCols(), self.getInputShapes(), sizes)
        check_shapes("label_shapes", self.getLabelCols(), self.getLabelShapes(), sizes)

    def _store(self) -> Store:
        """The ``store``; without one, a LocalStore removed when this Python process exits."""
        store: Store | None = self.getStore()
        if store is None:
            store = session_local_store()
            self._set(store=store)
            logger.info(
                "no store given: using a LocalStore at %s, removed when Python exits",
                store.prefix_path,
            )
        return store
