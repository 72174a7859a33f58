"""Spark ML Params of the estimators and models, declared the pyspark.ml / xgboost.spark way.

- :mod:`.base`: ``make_param`` / ``ParamGetter`` (a Param and its typed getter in one
  statement), declared defaults, generated accessors, the horovod alias table
  (:data:`ALIASES`) and the generated ``Parameters`` docs / keyword-only signatures;
- :mod:`.shared`: one-Param mixins (``HasFeatureCols``, ``HasLabelCols``, ...) as
  ``pyspark.ml.param.shared``, and ``SupervisedParams`` (optimizer, loss, metrics, ...) only on
  estimators that take them;
- :mod:`.common`: the Params every estimator has, by role, composed into
  :class:`EstimatorParams`;
- :mod:`.compat`: horovod keywords: refusals naming the alternative, defaults-only Params.

Decision (issue 19): an estimator has exactly the Params its framework uses. The Lightning
estimator has no ``optimizer``/``loss``/``metrics``/... Params (the ``LightningModule`` defines
them); passing one of those keywords raises a ``ConfigurationError`` naming the alternative.
"""

from spark_estimators.core.params.base import (
    ALIASES,
    DeclaredParams,
    ParamGetter,
    add_accessors,
    declared_defaults,
    document_constructor,
    make_param,
    parameters_section,
    to_camel,
    to_snake,
)
from spark_estimators.core.params.common import (
    DataParams,
    EstimatorParams,
    HorovodCompatParams,
    LaunchParams,
    TrainingParams,
)
from spark_estimators.core.params.compat import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    UNSUPPORTED,
    KeywordParams,
    check_unsupported,
)
from spark_estimators.core.params.shared import (
    HasFeatureCols,
    HasInputShapes,
    HasLabelCols,
    HasLossConstructors,
    HasTrainMinibatchFn,
    HasTransformBatchSize,
    SupervisedParams,
)

__all__ = [
    "ALIASES",
    "HOROVOD_DATA_MODULE_KEYWORDS",
    "UNSUPPORTED",
    "DataParams",
    "DeclaredParams",
    "EstimatorParams",
    "HasFeatureCols",
    "HasInputShapes",
    "HasLabelCols",
    "HasLossConstructors",
    "HasTrainMinibatchFn",
    "HasTransformBatchSize",
    "HorovodCompatParams",
    "KeywordParams",
    "LaunchParams",
    "ParamGetter",
    "SupervisedParams",
    "TrainingParams",
    "add_accessors",
    "check_unsupported",
    "declared_defaults",
    "document_constructor",
    "make_param",
    "parameters_section",
    "to_camel",
    "to_snake",
]
