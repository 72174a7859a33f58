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

from typing import Any

from spark_estimators.core.checkpoint import read_info
from spark_estimators.core.estimator import SparkEstimator, listify
from spark_estimators.core.params import (
    HOROVOD_DATA_MODULE_KEYWORDS,
    HasLossConstructors,
    HasTrainMinibatchFn,
    SupervisedParams,
    document_constructor,
)
from spark_estimators.core.params.base import keyword_only
from spark_estimators.errors import ConfigurationError
from spark_estimators.torch import indices, preflight, serialization
from spark_estimators.torch.model import TorchModel
from spark_estimators.torch.remote import (
    TorchTrainSpec,
    UserObjects,
    train,
)


class TorchEstimator(SparkEstimator, SupervisedParams, HasLossConstructors, HasTrainMinibatchFn):
    """Spark ML Estimator that trains a PyTorch model with data-parallel allreduce.

    Its keywords are horovod.spark.torch's (snake_case keywords or camelCase Params), listed in
    the constructor's Parameters; horovod's ``data_module``, ``continuous_cols`` and
    ``categorical_cols`` are accepted at None and refused otherwise, naming the alternative.
    """

    _framework = "torch"
    _horovod_only = HOROVOD_DATA_MODULE_KEYWORDS

    @keyword_only
    def __init__(
        self, *, model: Any = None, optimizer: Any = None, loss: Any = None, **params: Any
    ) -> None:
        super().__init__(**self._input_kwargs)

    # -- validation ------------------------------------------------------------------------------
    def _validate_framework(self) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "TorchEstimator needs PyTorch: pip install 'spark-estimators[torch]'"
            ) from exc
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

    def _losses(self) -> list[Any]:
        constructors = listify(self.getLossConstructors())
        if constructors:
            return [c() for c in constructors]
        return listify(self.getLoss())

    # -- training --------------------------------------------------------------------------------
    def _training_spec(self, meta: Any, store: Any, run_id: str, num_proc: int) -> TorchTrainSpec:
        losses = self._losses()
        if len(losses) == 1 and len(self.getLabelCols()) > 1:
            losses = losses * len(self.getLabelCols())
        # TorchScript modules cannot be pickled: they travel as torch.jit.save bytes.
        model, optimizer = serialization.pack(self.getModel(), self.getOptimizer())
        user = UserObjects(
            model=model,
            optimizer=optimizer,
            losses=losses,
            metrics=listify(self.getMetrics()),
            callbacks=listify(self.getCallbacks()),
            transformation_fn=self.getTransformationFn(),
            train_minibatch_fn=self.getTrainMinibatchFn(),
        )
        roots = [
            user.model,
            *user.losses,
            *[m for entry in user.metrics for m in listify(entry)],
            *user.callbacks,
            user.transformation_fn,
            user.train_minibatch_fn,
        ]
        remote_store = store.to_remote() if hasattr(store, "to_remote") else store
        info = read_info(store, run_id, "torch")
        index_cols = self._index_cols(meta, store, losses)
        spec = TorchTrainSpec(
            **self._spec_fields(user, roots, store, remote_store, meta, run_id, info),
            index_cols=[c.name for c in index_cols],
            loss_weights=self.getLossWeights(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            compression=self._compression_name(),
            scale_lr=self.getScaleLr(),
        )
        # The common first-fit mistakes fail here, in the driver, with the fix first.
        self._preflight_ms = preflight.check_model_on_rows(
            spec,
            self.getModel(),
            losses,
            store,
            meta,
            custom_batches=user.transformation_fn is not None
            or user.train_minibatch_fn is not None,
        )
        return spec

    def _index_cols(self, meta: Any, store: Any, losses: list[Any]) -> list[indices.IndexColumn]:
        """Floating columns fed as int64 class indices; checked to hold whole numbers.

        Kept for :meth:`_create_model` of the same fit (the model's ``indexCols``).
        """
        columns = dict(meta.columns)
        found = indices.label_index_cols(losses, self.getLabelCols(), columns)
        found += indices.embedding_index_cols(
            self.getModel(), self.getFeatureCols(), columns, self.getInputShapes()
        )
        indices.check_whole_numbers(store, meta, found)
        self._last_index_cols = found
        return found

    def _remote_trainer(self) -> Any:
        return train

    def _create_model(self, results: list[Any], meta: Any, run_id: str) -> TorchModel:
        model = self._trained_module(results)
        features = set(self.getFeatureCols())
        found = getattr(self, "_last_index_cols", [])
        index_cols = [c.name for c in found if c.name in features]
        fitted = self._wrap_model(TorchModel, model, results, run_id)
        if index_cols:
            fitted.setIndexCols(index_cols)
        return fitted


document_constructor(
    TorchEstimator,
    """Build a TorchEstimator; every keyword is optional here and checked when fitting.

    ``model`` (a ``torch.nn.Module``), ``optimizer`` (built on ``model.parameters()``) and
    ``loss`` (or ``loss_constructors``) are needed to fit; ``feature_cols`` and ``label_cols``
    name the columns. Positional arguments raise ``TypeError``.
    """,
)
