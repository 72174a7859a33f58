"""LightningEstimator: fit a ``LightningModule`` on a Spark DataFrame with Lightning's DDP.

>>> est = LightningEstimator(num_proc=2, model=MyModule(), feature_cols=["features"],
...                          label_cols=["label"], batch_size=64, epochs=5,
...                          validation=0.1)  # doctest: +SKIP
>>> lightning_model = est.fit(df)  # doctest: +SKIP
>>> lightning_model.transform(test_df).select("label__output").show()  # doctest: +SKIP

The module's own ``configure_optimizers``, ``training_step`` and ``validation_step`` train it;
a batch is a dict ``{column: tensor}`` of the feature, label (and sample weight) columns.
Each rank is a Spark task running Lightning's standard DDP strategy (see
:mod:`spark_estimators.lightning.remote`); checkpoints and logs go into the store.

Learning rate: **not scaled**. ``configure_optimizers`` owns the optimizer and its schedulers,
as in horovod's Lightning estimator, which did not scale it either. The effective batch is
``num_proc * batch_size``; to follow Horovod's rule, multiply the rate in ``configure_optimizers``
by ``self.trainer.world_size``. ``scale_lr=True`` is refused with that advice.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from pyspark.ml.param import TypeConverters

from spark_estimators.core import checks
from spark_estimators.core.estimator import SparkEstimator, listify
from spark_estimators.core.framework import FitData, FrameworkBase, RankResult, extend_spec
from spark_estimators.core.params import document_constructor, make_param
from spark_estimators.core.params.base import ParamGetter, keyword_only, to_int_or_none
from spark_estimators.core.training_run import TrainingRun, wrap_model
from spark_estimators.errors import ConfigurationError
from spark_estimators.lightning.callbacks import FRAMEWORK
from spark_estimators.lightning.model import LightningModel
from spark_estimators.lightning.preflight import check_training_step_on_rows
from spark_estimators.lightning.remote import LightningTrainSpec, LightningUserObjects, train
from spark_estimators.lightning.trainer import check_strategy
from spark_estimators.torch.estimator import trained_module

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from spark_estimators.core.checkpoint import CheckpointInfo
    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.store.base import Store

#: The oldest pytorch_lightning this estimator supports (horovod's example imports the name).
MIN_PL_VERSION = "2.0.0"

#: Trainer arguments the estimator sets itself: the param to use instead.
_RESERVED_TRAINER_ARGS = {
    "devices": "num_proc (one device per rank)",
    "num_nodes": "num_proc (one device per rank)",
    "accelerator": "num_gpus / use_gpu",
    "max_epochs": "epochs",
    "callbacks": "callbacks",
    "logger": "logger",
    "profiler": "profiler",
    "log_every_n_steps": "log_every_n_steps",
    "accumulate_grad_batches": "backward_passes_per_step",
    "use_distributed_sampler": "nothing: the estimator's reader already shards the data",
    "enable_checkpointing": "nothing: checkpoints into the store are needed for hot-start",
    "plugins": "nothing: the estimator sets the cluster environment",
    "default_root_dir": "store (checkpoints and logs go into the run's directory)",
}
#: Keywords of the Torch estimator whose job the LightningModule does: the values that mean "not
#: given" (accepted), and where the module does it.
_MODULE_DOES: dict[str, tuple[tuple[Any, ...], str]] = {
    "optimizer": ((None,), "configure_optimizers() of the module builds the optimizer"),
    "loss": ((None,), "training_step() of the module computes the loss"),
    "loss_constructors": ((None, []), "training_step() of the module computes the loss"),
    "loss_weights": ((None, []), "training_step() of the module computes the loss"),
    "metrics": ((None, []), "log metrics with self.log(...) (torchmetrics work) in the module"),
    "gradient_compression": ((None,), "LightningEstimator runs DDP without gradient compression"),
    "train_minibatch_fn": (
        (None,),
        "training_step() of the module is the step (use manual optimization for a custom one)",
    ),
}
_NOT_FOR_LIGHTNING = {
    key: (unused, f"{where}; remove {key}=") for key, (unused, where) in _MODULE_DOES.items()
}
_PROFILERS = ("simple", "advanced", "pytorch")


class LightningEstimator(SparkEstimator):
    """Spark ML Estimator that trains a ``pytorch_lightning.LightningModule`` with DDP.

    Its keywords are horovod.spark.lightning's (snake_case keywords or camelCase Params), listed
    in the constructor's Parameters; ``collective_backend`` is "auto", "gloo" or "nccl",
    ``backward_passes_per_step`` is Lightning's ``accumulate_grad_batches``. It has no
    ``optimizer``, ``loss``, ``loss_constructors``, ``loss_weights``, ``metrics``,
    ``gradient_compression`` or ``train_minibatch_fn``: the module defines those, and passing
    one raises a ``ConfigurationError`` naming the alternative.

    ``num_gpus``: None uses the task's GPU when Spark assigned one, 0 trains on the CPU, 1
    requires a GPU per rank. ``logger``: None writes TensorBoard logs into the run's ``logs/``
    in the store; a Lightning logger is used as given; False turns logging off.
    ``trainer_args`` is merged into ``Trainer(...)`` (e.g. ``precision``, ``gradient_clip_val``);
    arguments the estimator owns are refused with the param to use instead.
    horovod's ``loader_num_epochs``, ``data_module``, ``debug_data_loader`` and
    ``train/val_async_data_loader_queue_size`` are accepted only at their defaults: the reader
    delivers exactly one pass over each rank's shard per epoch; other values are refused with
    the alternative. A ``ModelCheckpoint`` with a
    ``monitor`` among ``callbacks`` makes the returned model hold its best checkpoint (as horovod
    did); otherwise it holds the final weights.
    """

    getNumGpus = ParamGetter("GPUs per rank: None (auto), 0 or 1", to_int_or_none)
    getLogger: ParamGetter[pl.loggers.Logger | list[pl.loggers.Logger] | bool | None] = ParamGetter(
        "Lightning logger (default TensorBoard into the store)"
    )
    getLogEveryNSteps = ParamGetter("Trainer(log_every_n_steps=...)", TypeConverters.toInt)
    trainerArgs = make_param("trainerArgs", "dict of extra Trainer(...) arguments")
    getProfiler: ParamGetter[pl.profilers.Profiler | str | None] = ParamGetter(
        "'simple', 'advanced', 'pytorch' or a Lightning Profiler"
    )
    getTerminateOnNan = ParamGetter(
        "stop with an error on a NaN/inf loss or weight", TypeConverters.toBoolean
    )
    getLoaderNumEpochs = ParamGetter(
        "horovod compatibility: only None (one pass per epoch)", to_int_or_none
    )
    dataModule = make_param(
        "dataModule", "horovod compatibility: only None (the reader is built in)"
    )
    debugDataLoader = make_param(
        "debugDataLoader", "horovod compatibility: only False", TypeConverters.toBoolean
    )
    trainAsyncDataLoaderQueueSize = make_param(
        "trainAsyncDataLoaderQueueSize", "horovod compatibility: only None", to_int_or_none
    )
    valAsyncDataLoaderQueueSize = make_param(
        "valAsyncDataLoaderQueueSize", "horovod compatibility: only None", to_int_or_none
    )

    # horovod Lightning params with no equivalent: refused with the alternative (see
    # spark_estimators.core.params.check_unsupported).
    _unsupported: dict[str, tuple[str, Any, str]] = {
        "loaderNumEpochs": (
            "loader_num_epochs",
            (None,),
            "the reader delivers exactly one pass over each rank's shard per epoch; use "
            "train_steps_per_epoch to shorten epochs, or remove loader_num_epochs",
        ),
        "dataModule": (
            "data_module",
            (None,),
            "batches come from the built-in reader over the prepared data; shape them with "
            "transformation_fn, input_shapes and label_shapes, or remove data_module",
        ),
        "debugDataLoader": (
            "debug_data_loader",
            (False, None),
            "the reader logs at DEBUG on logger 'spark_estimators.data.reader'; remove it",
        ),
        "trainAsyncDataLoaderQueueSize": (
            "train_async_data_loader_queue_size",
            (None,),
            "the reader prefetches on its own thread; use train_reader_num_workers, or remove it",
        ),
        "valAsyncDataLoaderQueueSize": (
            "val_async_data_loader_queue_size",
            (None,),
            "the reader prefetches on its own thread; use val_reader_num_workers, or remove it",
        ),
    }

    _not_taken = _NOT_FOR_LIGHTNING
    _defaults: ClassVar[dict[str, Any]] = {
        "numGpus": None,
        "logger": None,
        "logEveryNSteps": 50,
        "trainerArgs": None,
        "profiler": None,
        "terminateOnNan": False,
        "loaderNumEpochs": None,
        "dataModule": None,
        "debugDataLoader": False,
        "trainAsyncDataLoaderQueueSize": None,
        "valAsyncDataLoaderQueueSize": None,
        "scaleLr": False,
    }

    @keyword_only
    def __init__(self, *, model: pl.LightningModule | None = None, **params: object) -> None:
        super().__init__(**self._input_kwargs)

    def getTrainerArgs(self) -> dict[str, object]:
        """Gets the value of ``trainerArgs`` or its default value."""
        return dict(self.getOrDefault(self.trainerArgs) or {})

    # -- validation ------------------------------------------------------------------------------
    def _validate_framework(self) -> None:
        pl = checks.import_framework(
            "pytorch_lightning",
            "LightningEstimator needs PyTorch Lightning",
            "spark-estimators[lightning]",
        )
        model = self.getModel()
        if not isinstance(model, pl.LightningModule):
            hint = (
                " For a plain torch.nn.Module use spark_estimators.torch.TorchEstimator."
                if _is_torch_module(model)
                else ""
            )
            raise ConfigurationError(
                f"model must be a pytorch_lightning.LightningModule, got {type(model).__name__}."
                + hint
            )
        if self.getScaleLr():
            raise ConfigurationError(
                "scale_lr=True is not supported by LightningEstimator: configure_optimizers() "
                "owns the learning rate. Multiply it there by self.trainer.world_size to scale "
                "it with the number of ranks."
            )
        if self.getCollectiveBackend() not in ("auto", "gloo", "nccl"):
            raise ConfigurationError(
                f"collective_backend={self.getCollectiveBackend()!r} is invalid for "
                "LightningEstimator: Lightning's DDP runs on torch.distributed, use 'auto', "
                "'gloo' or 'nccl'"
            )
        if self.getNumGpus() not in (None, 0, 1):
            raise ConfigurationError(
                f"num_gpus={self.getNumGpus()!r} is invalid: each rank drives one device, so use "
                "None (the task's GPU if any), 0 or 1, and raise num_proc for more GPUs"
            )
        if self.getNumGpus() == 1 and self.getUseGpu() is False:
            raise ConfigurationError("num_gpus=1 conflicts with use_gpu=False: set one of them")
        if self.getLogEveryNSteps() < 1:
            raise ConfigurationError(
                f"log_every_n_steps={self.getLogEveryNSteps()!r} is invalid: expected an int >= 1"
            )
        shapes = self.getLabelShapes()
        if shapes is not None and len(shapes) != len(self.getLabelCols()):
            raise ConfigurationError(
                f"label_shapes has {len(shapes)} entries but there are "
                f"{len(self.getLabelCols())} label columns: give one shape per label column"
            )
        self._validate_trainer_args()
        self._validate_lightning_objects(pl)

    def _validate_trainer_args(self) -> None:
        raw = self.getOrDefault(self.trainerArgs)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigurationError(
                f"trainer_args={raw!r} is invalid: expected a dict of Trainer(...) arguments"
            )
        import pytorch_lightning as pl

        known = [p for p in inspect.signature(pl.Trainer.__init__).parameters if p != "self"]
        args = raw or {}
        for key in args:
            if key == "strategy":
                check_strategy(args[key])
                continue
            if key in _RESERVED_TRAINER_ARGS:
                raise ConfigurationError(
                    f"trainer_args[{key!r}] is set by LightningEstimator; use "
                    f"{_RESERVED_TRAINER_ARGS[key]} instead"
                )
            if key not in known:
                close = difflib.get_close_matches(key, known, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise ConfigurationError(
                    f"trainer_args[{key!r}] is not an argument of pytorch_lightning.Trainer.{hint}"
                )

    def _validate_lightning_objects(self, pl: ModuleType) -> None:
        for cb in listify(self.getCallbacks()):
            if not isinstance(cb, pl.Callback):
                raise ConfigurationError(
                    f"callbacks must be pytorch_lightning.Callback objects, got {type(cb).__name__}"
                )
        log = self.getLogger()
        if log is not None and log is not False:
            from pytorch_lightning.loggers import Logger

            if not all(isinstance(one, Logger) for one in listify(log)):
                raise ConfigurationError(
                    f"logger={log!r} is invalid: expected a pytorch_lightning logger, a list "
                    "of them, None (TensorBoard into the store) or False (no logging)"
                )
        profiler = self.getProfiler()
        if isinstance(profiler, str) and profiler not in _PROFILERS:
            raise ConfigurationError(
                f"profiler={profiler!r} is invalid: expected one of {_PROFILERS}, a "
                "pytorch_lightning Profiler or None"
            )
        if profiler is not None and not isinstance(profiler, str):
            from pytorch_lightning.profilers import Profiler

            if not isinstance(profiler, Profiler):
                raise ConfigurationError(
                    f"profiler={profiler!r} is invalid: expected one of {_PROFILERS}, a "
                    "pytorch_lightning Profiler or None"
                )

    def _training_run(self) -> TrainingRun:
        return TrainingRun(self, LightningFramework(self))


class LightningFramework(FrameworkBase["LightningEstimator"]):
    """What a Lightning fit adds to its TrainingRun (see :mod:`spark_estimators.core.framework`)."""

    name = FRAMEWORK

    def trainer(self) -> Callable[[LightningTrainSpec], RankResult]:
        """The rank entry point: :func:`spark_estimators.lightning.remote.train`."""
        return train

    def shipped(self) -> tuple[LightningUserObjects, list[object]]:
        """The LightningModule, callbacks, logger, profiler and ``transformation_fn``."""
        est = self.est
        user = LightningUserObjects(
            model=est.getModel(),
            callbacks=listify(est.getCallbacks()),
            logger=est.getLogger(),
            profiler=est.getProfiler(),
            transformation_fn=est.getTransformationFn(),
        )
        return user, [user.model, *listify(user.logger)]

    def build_spec(
        self, shared: TrainSpec, data: FitData, store: Store, info: CheckpointInfo | None
    ) -> LightningTrainSpec:
        """The Lightning spec; a hot start resumes from the checkpoint file ``info`` names."""
        est = self.est
        return extend_spec(
            shared,
            LightningTrainSpec,
            num_gpus=est.getNumGpus(),
            collective_backend=est.getCollectiveBackend(),
            backward_passes_per_step=est.getBackwardPassesPerStep(),
            log_every_n_steps=est.getLogEveryNSteps(),
            trainer_args=est.getTrainerArgs(),
            terminate_on_nan=est.getTerminateOnNan(),
            verbose=est.getVerbose(),
            checkpoint_file=None if info is None else str(info.extra["checkpoint"]),
        )

    def check_spec(self, spec: TrainSpec, store: Store, data: FitData) -> float:
        """Run ``training_step`` on a few prepared rows (see ``lightning/preflight.py``)."""
        est = self.est
        custom = est.getTransformationFn() is not None
        return check_training_step_on_rows(spec, est.getModel(), store, data, custom_batches=custom)

    def build_model(self, results: list[RankResult], run_id: str) -> LightningModel:
        """A LightningModel of rank 0's weights with its logged metrics."""
        first = results[0]
        return wrap_model(
            self.est,
            LightningModel,
            trained_module(self.est.getModel(), results),
            results,
            run_id,
            logged_metrics=first["logged_metrics"],
            forward_error=first["forward_error"],
        )


def _is_torch_module(value: object) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, torch.nn.Module)


document_constructor(
    LightningEstimator,
    """Build a LightningEstimator; every keyword is optional here and checked when fitting.

    ``model`` (a ``pytorch_lightning.LightningModule``) is needed to fit; ``feature_cols`` and
    ``label_cols`` name the columns. Positional arguments raise ``TypeError``.
    """,
)
