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
    make_param,
    to_list_or_none,
    to_str_list,
)

# -- columns and shapes: estimators and models ---------------------------------------------------


class HasFeatureCols(DeclaredParams):
    """Mixin for ``featureCols``: the feature columns, one model input each."""

    featureCols = make_param("featureCols", "feature column names", to_str_list)
    _defaults: ClassVar[dict[str, object]] = {"featureCols": []}

    def getFeatureCols(self) -> list[str]:
        """Gets the value of ``featureCols`` or its default value."""
        return self.getOrDefault(self.featureCols)


class HasLabelCols(DeclaredParams):
    """Mixin for ``labelCols``: the label columns, one model output each."""

    labelCols = make_param("labelCols", "label column names", to_str_list)
    _defaults: ClassVar[dict[str, object]] = {"labelCols": []}

    def getLabelCols(self) -> list[str]:
        """Gets the value of ``labelCols`` or its default value."""
        return self.getOrDefault(self.labelCols)


class HasInputShapes(DeclaredParams):
    """Mixin for ``inputShapes``: the shape of each feature input."""

    inputShapes = make_param(
        "inputShapes", "shape of each feature input, with -1 for the batch (horovod's rule)"
    )
    _defaults: ClassVar[dict[str, object]] = {"inputShapes": None}

    def getInputShapes(self) -> list[list[int] | None] | None:
        """Gets the value of ``inputShapes`` or its default value."""
        return self.getOrDefault(self.inputShapes)


class HasTransformBatchSize(DeclaredParams):
    """Mixin for ``transformBatchSize``: rows per inference batch in ``transform``."""

    transformBatchSize = make_param(
        "transformBatchSize", "rows per inference batch in transform()", TypeConverters.toInt
    )
    _defaults: ClassVar[dict[str, object]] = {"transformBatchSize": 1024}

    def getTransformBatchSize(self) -> int:
        """Gets the value of ``transformBatchSize`` or its default value."""
        return self.getOrDefault(self.transformBatchSize)


# -- supervised training: what the user hands in besides the model -----------------------------


class HasOptimizer(DeclaredParams):
    """Mixin for ``optimizer``: the framework optimizer the estimator drives."""

    optimizer = make_param("optimizer", "optimizer (bound to the model's parameters)")
    _defaults: ClassVar[dict[str, object]] = {"optimizer": None}

    def getOptimizer(self) -> object:
        """Gets the value of ``optimizer`` or its default value."""
        return self.getOrDefault(self.optimizer)


class HasLoss(DeclaredParams):
    """Mixin for ``loss``: one loss, or one per label column."""

    loss = make_param("loss", "loss function, or a list of them, one per label column")
    _defaults: ClassVar[dict[str, object]] = {"loss": None}

    def getLoss(self) -> object:
        """Gets the value of ``loss`` or its default value."""
        return self.getOrDefault(self.loss)


class HasLossConstructors(DeclaredParams):
    """Mixin for ``lossConstructors``: callables that build the losses (instead of ``loss``)."""

    lossConstructors = make_param(
        "lossConstructors", "callables that build the loss functions (instead of loss)"
    )
    _defaults: ClassVar[dict[str, object]] = {"lossConstructors": None}

    def getLossConstructors(self) -> object:
        """Gets the value of ``lossConstructors`` or its default value."""
        return self.getOrDefault(self.lossConstructors)


class HasLossWeights(DeclaredParams):
    """Mixin for ``lossWeights``: the weight of each label's loss."""

    lossWeights = make_param("lossWeights", "weights of each label's loss", to_list_or_none)
    _defaults: ClassVar[dict[str, object]] = {"lossWeights": None}

    def getLossWeights(self) -> list[float] | None:
        """Gets the value of ``lossWeights`` or its default value."""
        return self.getOrDefault(self.lossWeights)


class HasMetrics(DeclaredParams):
    """Mixin for ``metrics``: metric functions averaged over the ranks every epoch."""

    metrics = make_param("metrics", "metric functions metric(output, label) -> value")
    _defaults: ClassVar[dict[str, object]] = {"metrics": None}

    def getMetrics(self) -> object:
        """Gets the value of ``metrics`` or its default value."""
        return self.getOrDefault(self.metrics)


class HasGradientCompression(DeclaredParams):
    """Mixin for ``gradientCompression``: compression of the gradients' allreduce."""

    gradientCompression = make_param(
        "gradientCompression", "Compression.none or Compression.fp16 for the gradients' allreduce"
    )
    _defaults: ClassVar[dict[str, object]] = {"gradientCompression": None}

    def getGradientCompression(self) -> object:
        """Gets the value of ``gradientCompression`` or its default value."""
        return self.getOrDefault(self.gradientCompression)

    def _compression_name(self) -> str:
        """``"none"``, ``"fp16"`` or (invalid) another name, from the compression given."""
        compression = self.getGradientCompression()
        if compression is None:
            return "none"
        if isinstance(compression, str):
            return compression
        name = getattr(compression, "__name__", type(compression).__name__).lower()
        return "fp16" if "fp16" in name else "none" if "none" in name else name


class HasTrainMinibatchFn(DeclaredParams):
    """Mixin for ``trainMinibatchFn``: horovod's custom training step."""

    trainMinibatchFn = make_param(
        "trainMinibatchFn",
        "custom fn(model, optimizer, transform_outputs, "
        "loss_fn, inputs, labels, sample_weights) -> (outputs, loss)",
    )
    _defaults: ClassVar[dict[str, object]] = {"trainMinibatchFn": None}

    def getTrainMinibatchFn(self) -> Any:
        """Gets the value of ``trainMinibatchFn`` or its default value."""
        return self.getOrDefault(self.trainMinibatchFn)


class SupervisedParams(HasOptimizer, HasLoss, HasLossWeights, HasMetrics, HasGradientCompression):
    """The Params of estimators that take the optimizer, loss and metrics from the user."""
