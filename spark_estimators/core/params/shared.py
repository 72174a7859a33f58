"""One-Param mixins shared by several stages, as ``pyspark.ml.param.shared`` (``HasInputCol``).

The column mixins serve both estimators and models; the supervised mixins (optimizer, loss,
metrics, ...) only the estimators whose framework takes them from the user: the Torch and Keras
estimators compose them, the Lightning estimator does not (its ``LightningModule`` defines its
optimizer, loss and metrics), so it has no such Param at all.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pyspark.ml.param import TypeConverters

from spark_estimators.core.params.base import (
    DeclaredParams,
    ParamGetter,
    to_loss_weights,
    to_str_list,
)

# -- columns and shapes: estimators and models ---------------------------------------------------


class HasFeatureCols(DeclaredParams):
    """Mixin for ``featureCols``: the feature columns, one model input each."""

    getFeatureCols = ParamGetter("feature column names", to_str_list)
    _defaults: ClassVar[dict[str, object]] = {"featureCols": []}


class HasLabelCols(DeclaredParams):
    """Mixin for ``labelCols``: the label columns, one model output each."""

    getLabelCols = ParamGetter("label column names", to_str_list)
    _defaults: ClassVar[dict[str, object]] = {"labelCols": []}


class HasInputShapes(DeclaredParams):
    """Mixin for ``inputShapes``: the shape of each feature input."""

    getInputShapes: ParamGetter[list[list[int] | None] | None] = ParamGetter(
        "shape of each feature input, with -1 for the batch (horovod's rule)"
    )
    _defaults: ClassVar[dict[str, object]] = {"inputShapes": None}


class HasTransformBatchSize(DeclaredParams):
    """Mixin for ``transformBatchSize``: rows per inference batch in ``transform``."""

    getTransformBatchSize = ParamGetter(
        "rows per inference batch in transform()", TypeConverters.toInt
    )
    _defaults: ClassVar[dict[str, object]] = {"transformBatchSize": 1024}


# -- supervised training: what the user hands in besides the model -----------------------------


class HasLossConstructors(DeclaredParams):
    """Mixin for ``lossConstructors``: callables that build the losses (instead of ``loss``)."""

    getLossConstructors: ParamGetter[object] = ParamGetter(
        "callables that build the loss functions (instead of loss)"
    )
    _defaults: ClassVar[dict[str, object]] = {"lossConstructors": None}


class HasTrainMinibatchFn(DeclaredParams):
    """Mixin for ``trainMinibatchFn``: horovod's custom training step."""

    getTrainMinibatchFn: ParamGetter[Any] = ParamGetter(
        "custom fn(model, optimizer, transform_outputs, "
        "loss_fn, inputs, labels, sample_weights) -> (outputs, loss)",
    )
    _defaults: ClassVar[dict[str, object]] = {"trainMinibatchFn": None}


class SupervisedParams(DeclaredParams):
    """The Params of estimators that take the optimizer, loss and metrics from the user.

    The Torch and Keras estimators take all five together (the Lightning estimator none), so
    they are declared here as one group rather than as five one-Param mixins.
    """

    getOptimizer: ParamGetter[object] = ParamGetter("optimizer (bound to the model's parameters)")
    getLoss: ParamGetter[object] = ParamGetter(
        "loss function, or a list of them, one per label column"
    )
    getLossWeights = ParamGetter(
        "weights of each label's loss: a list, or (Keras) a dict of output name -> weight",
        to_loss_weights,
    )
    getMetrics: ParamGetter[object] = ParamGetter("metric functions metric(output, label) -> value")
    getGradientCompression: ParamGetter[object] = ParamGetter(
        "Compression.none or Compression.fp16 for the gradients' allreduce"
    )
    _defaults: ClassVar[dict[str, object]] = {
        "optimizer": None,
        "loss": None,
        "lossWeights": None,
        "metrics": None,
        "gradientCompression": None,
    }

    def _compression_name(self) -> str:
        """``"none"``, ``"fp16"`` or (invalid) another name, from the compression given."""
        compression = self.getGradientCompression()
        if compression is None:
            return "none"
        if isinstance(compression, str):
            return compression
        name = getattr(compression, "__name__", type(compression).__name__).lower()
        return "fp16" if "fp16" in name else "none" if "none" in name else name
