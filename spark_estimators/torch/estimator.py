"""TorchEstimator: fit a ``torch.nn.Module`` on a Spark DataFrame, data-parallel on Spark tasks.

>>> est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters()),
...                      loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"],
...                      batch_size=64, epochs=5, validation=0.1)  # doctest: +SKIP
>>> torch_model = est.fit(df)  # doctest: +SKIP
>>> torch_model.transform(test_df).select("y__output").show()  # doctest: +SKIP

Learning rate: pass the rate you would use on one process; it is multiplied by the number of
ranks, as Horovod's estimators do (the effective batch is ``num_proc * batch_size``);
``scale_lr=False`` keeps it as given.

Callbacks are objects with any of ``on_train_begin(logs)``, ``on_epoch_begin(epoch, logs)``,
``on_epoch_end(epoch, logs)`` and ``on_train_end(logs)``; they run on every rank with metrics
already averaged over the ranks, and setting ``callback.stop_training = True`` stops every rank
after that epoch (see :class:`spark_estimators.torch.EarlyStopping`).

Class indices: a floating label column of a classification loss (``CrossEntropyLoss``,
``NLLLoss``, ...) and a floating feature column that feeds an ``nn.Embedding``/``EmbeddingBag``
(``StringIndexer`` output) are cast to int64 on the ranks and in ``transform``; the driver picks
them and refuses fractional values before training (:mod:`spark_estimators.torch.indices`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias, cast

from spark_estimators.core import checks
from spark_estimators.core.estimator import SparkEstimator, listify
from spark_estimators.core.framework import FitData, FrameworkBase, RankResult, extend_spec
from spark_estimators.core.params import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    HasLossConstructors,
    HasTrainMinibatchFn,
    SupervisedParams,
    document_constructor,
)
from spark_estimators.core.params.base import keyword_only
from spark_estimators.core.training_run import TrainingRun, wrap_model
from spark_estimators.errors import ConfigurationError
from spark_estimators.torch import indices, preflight, serialization
from spark_estimators.torch.model import TorchModel
from spark_estimators.torch.remote import FRAMEWORK, TorchTrainSpec, UserObjects, train

if TYPE_CHECKING:
    import torch

    from spark_estimators.core.checkpoint import CheckpointInfo
    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.store.base import Store

#: A loss: ``loss(output, label) -> scalar tensor`` (a ``torch.nn`` loss module or a function).
LossFn: TypeAlias = "Callable[..., torch.Tensor]"


class TorchEstimator(SparkEstimator, SupervisedParams, HasLossConstructors, HasTrainMinibatchFn):
    """Spark ML Estimator that trains a PyTorch model with data-parallel allreduce.

    Its keywords are horovod.spark.torch's (snake_case keywords or camelCase Params), listed in
    the constructor's Parameters; horovod's ``data_module``, ``continuous_cols`` and
    ``categorical_cols`` are accepted at None and refused otherwise, naming the alternative.
    """

    _horovod_only = HOROVOD_DATA_MODULE_KEYWORDS

    @keyword_only
    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        loss: object = None,
        **params: object,
    ) -> None:
        super().__init__(**self._input_kwargs)

    # -- validation ------------------------------------------------------------------------------
    def _validate_framework(self) -> None:
        torch = checks.import_framework(
            "torch", "TorchEstimator needs PyTorch", "spark-estimators[torch]"
        )
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"optimizer must be a torch.optim.Optimizer built on model.parameters(), got "
                f"{type(optimizer).__name__}"
            )
        params = {id(p) for p in model.parameters()}
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not opt_params <= params:
            raise ConfigurationError(
                "optimizer holds parameters that are not the model's: build it with "
                "optimizer=torch.optim.X(model.parameters(), ...) on the same model object"
            )
        if self.getLoss() is not None and listify(self.getLossConstructors()):
            raise ConfigurationError(
                "loss and loss_constructors were both given: pass only one of them (as Horovod "
                "requires)"
            )
        losses = self._losses()
        if not losses:
            raise ConfigurationError(
                "loss is required: pass loss=torch.nn.MSELoss() (one per label column, or one "
                "for all) or loss_constructors=[...]"
            )
        if len(losses) not in (1, len(self.getLabelCols())):
            raise ConfigurationError(
                f"{len(losses)} losses for {len(self.getLabelCols())} label columns: give one "
                "loss, or one per label column"
            )
        if isinstance(self.getLossWeights(), dict):
            raise ConfigurationError(
                f"loss_weights={self.getLossWeights()!r} is a dict: name-keyed weights are for "
                "KerasEstimator's named outputs; give a list, one weight per label column"
            )
        n_labels = len(self.getLabelCols())
        for entry in listify(self.getMetrics()):
            group = listify(entry)
            if len(group) not in (1, n_labels) or not all(callable(m) for m in group):
                raise ConfigurationError(
                    f"metrics entry {entry!r} is invalid: give a function fn(output, label), or "
                    f"a list of one function (for every output) or of {n_labels} (one per "
                    "label column), as Horovod's metric groups"
                )
        minibatch_fn = self.getTrainMinibatchFn()
        if minibatch_fn is not None and not callable(minibatch_fn):
            raise ConfigurationError(
                f"train_minibatch_fn={minibatch_fn!r} is not callable: pass fn(model, optimizer, "
                "transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, loss)"
            )
        if minibatch_fn is not None and self.getBackwardPassesPerStep() > 1:
            raise ConfigurationError(
                f"backward_passes_per_step={self.getBackwardPassesPerStep()} cannot be combined "
                "with train_minibatch_fn, which calls optimizer.step() on every batch itself: "
                "use backward_passes_per_step=1, or drop train_minibatch_fn"
            )
        compression = self.getGradientCompression()
        if compression is not None and self._compression_name() not in ("none", "fp16"):
            raise ConfigurationError(
                f"gradient_compression={compression!r} is not Compression.none or Compression.fp16"
            )

    def _losses(self) -> list[LossFn]:
        constructors = listify(self.getLossConstructors())
        if constructors:
            return [c() for c in constructors]
        return listify(self.getLoss())

    def _training_run(self) -> TrainingRun:
        return TrainingRun(self, TorchFramework(self))


class TorchFramework(FrameworkBase["TorchEstimator"]):
    """What a torch fit adds to its TrainingRun (see :mod:`spark_estimators.core.framework`)."""

    name = FRAMEWORK

    def __init__(self, est: TorchEstimator) -> None:
        super().__init__(est)
        self.losses: list[LossFn] = []  # one per label column, from shipped()
        # Floating columns fed as int64 class indices (build_spec; the model's indexCols).
        self.index_cols: list[indices.IndexColumn] = []

    def trainer(self) -> Callable[[TorchTrainSpec], RankResult]:
        """The rank entry point: :func:`spark_estimators.torch.remote.train`."""
        return train

    def shipped(self) -> tuple[UserObjects, list[object]]:
        """The model, optimizer (TorchScript as bytes), losses, metrics, callbacks and functions."""
        est = self.est
        losses = est._losses()
        if len(losses) == 1 and len(est.getLabelCols()) > 1:
            losses = losses * len(est.getLabelCols())
        self.losses = losses
        # TorchScript modules cannot be pickled: they travel as torch.jit.save bytes.
        model, optimizer = serialization.pack(
            est.getModel(), cast("torch.optim.Optimizer", est.getOptimizer())
        )
        user = UserObjects(
            model=model,
            optimizer=optimizer,
            losses=losses,
            metrics=listify(est.getMetrics()),
            callbacks=listify(est.getCallbacks()),
            transformation_fn=est.getTransformationFn(),
            train_minibatch_fn=est.getTrainMinibatchFn(),
        )
        roots = [
            user.model,
            *user.losses,
            *[m for entry in user.metrics for m in listify(entry)],
            user.train_minibatch_fn,
        ]
        return user, roots

    def build_spec(
        self, shared: TrainSpec, data: FitData, store: Store, info: CheckpointInfo | None
    ) -> TorchTrainSpec:
        """The torch spec; floating class-index columns are found and checked here."""
        est = self.est
        columns = dict(data.columns)
        found = indices.label_index_cols(self.losses, est.getLabelCols(), columns)
        found += indices.embedding_index_cols(
            est.getModel(), est.getFeatureCols(), columns, est.getInputShapes()
        )
        indices.check_whole_numbers(store, data, found)
        self.index_cols = found
        return extend_spec(
            shared,
            TorchTrainSpec,
            index_cols=[c.name for c in found],
            loss_weights=est.getLossWeights(),
            backward_passes_per_step=est.getBackwardPassesPerStep(),
            compression=est._compression_name(),
            scale_lr=est.getScaleLr(),
        )

    def check_spec(self, spec: TrainSpec, store: Store, data: FitData) -> float:
        """Run the model and loss on a few prepared rows (see ``torch/preflight.py``)."""
        est = self.est
        custom = est.getTransformationFn() is not None or est.getTrainMinibatchFn() is not None
        return preflight.check_model_on_rows(
            spec, est.getModel(), self.losses, store, data, custom_batches=custom
        )

    def build_model(self, results: list[RankResult], run_id: str) -> TorchModel:
        """A TorchModel of rank 0's weights; ``indexCols``: the feature columns cast to int64."""
        model = trained_module(self.est.getModel(), results)
        fitted = wrap_model(self.est, TorchModel, model, results, run_id)
        features = set(self.est.getFeatureCols())
        index_cols = [c.name for c in self.index_cols if c.name in features]
        if index_cols:
            fitted.setIndexCols(index_cols)
        return fitted


def trained_module(module: torch.nn.Module, results: list[RankResult]) -> torch.nn.Module:
    """A CPU copy of ``module`` with rank 0's final weights, in eval mode.

    Every rank must have ended with the same trainable parameters (checked first).
    """
    checks.check_fingerprints(results)
    trained = copy.deepcopy(module).cpu()
    trained.load_state_dict(results[0]["state_dict"])
    trained.eval()
    return trained


document_constructor(
    TorchEstimator,
    """Build a TorchEstimator; every keyword is optional here and checked when fitting.

    ``model`` (a ``torch.nn.Module``), ``optimizer`` (built on ``model.parameters()``) and
    ``loss`` (or ``loss_constructors``) are needed to fit; ``feature_cols`` and ``label_cols``
    name the columns. Positional arguments raise ``TypeError``.
    """,
)
