"""The ``pytorch_lightning.Trainer`` a ``LightningEstimator`` rank builds (executor side).

Lightning's standard ``DDPStrategy`` on :class:`SparkClusterEnvironment` (``devices=1,
num_nodes=world_size``: each rank process drives one device), the device check, the logger and
profiler writing into the run's logs directory, Lightning's output kept to what helps, and the
weights-only load of a resumed checkpoint. The training itself is
:mod:`spark_estimators.lightning.remote`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spark_estimators.core.rank import light_tensorboard
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.loggers import Logger
    from pytorch_lightning.profilers import Profiler

logger = logging.getLogger(__name__)


class TrainerSpec(Protocol):
    """What the trainer set-up reads of ``LightningTrainSpec`` (whose module imports this one)."""

    @property
    def num_gpus(self) -> int | None:
        """GPUs per rank (``None``: decided by ``use_gpu``)."""

    @property
    def use_gpu(self) -> bool | None:
        """Whether ranks train on CUDA (``None``: when one is there)."""

    @property
    def collective_backend(self) -> str:
        """The collective backend's name."""

    @property
    def epochs(self) -> int:
        """Epochs to train."""

    @property
    def log_every_n_steps(self) -> int:
        """Lightning's logging interval."""

    @property
    def backward_passes_per_step(self) -> int:
        """Local gradient accumulation steps."""

    @property
    def verbose(self) -> int:
        """Verbosity of the rank's output."""

    @property
    def trainer_args(self) -> Mapping[str, object]:
        """Extra ``pl.Trainer`` keywords."""


def rank_uses_cuda(spec: TrainerSpec) -> bool:
    """Whether this rank trains on its GPU (``num_gpus=1`` without one is an error)."""
    import torch

    from spark_estimators.task import get_device

    has_gpu = get_device().startswith("cuda") and torch.cuda.is_available()
    if spec.num_gpus == 1 and not has_gpu:
        raise RuntimeError(
            "num_gpus=1 but this rank has no GPU (Spark assigned none to its task, or torch "
            "sees no CUDA device); request GPUs with spark.task.resource.gpu.amount or use "
            "num_gpus=0"
        )
    if spec.num_gpus == 0 or spec.use_gpu is False:
        return False
    return has_gpu


def _own_cuda_index() -> int:
    from spark_estimators.task import get_device

    return int(get_device().split(":")[1])


def _process_group_backend(spec: TrainerSpec, use_cuda: bool) -> str:
    if spec.collective_backend == "auto":
        return "nccl" if use_cuda else "gloo"
    if spec.collective_backend == "nccl" and not use_cuda:
        raise RuntimeError("collective_backend='nccl' needs a GPU on every rank; use 'auto'")
    return spec.collective_backend


def make_logger(
    user_logger: Logger | list[Logger] | bool | None, logs_dir: str
) -> Logger | list[Logger] | bool:
    """The user's logger (or False), else a TensorBoardLogger into ``logs_dir``."""
    if user_logger is not None:
        return user_logger  # a logger the user configured, or False for none
    light_tensorboard()
    try:
        from pytorch_lightning.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=logs_dir, name="", version="", default_hp_metric=False)
    except ModuleNotFoundError:
        logger.warning("tensorboard is not installed: no TensorBoard logs for this run")
        return False


def make_profiler(profiler: Profiler | str | None, logs_dir: str) -> Profiler | None:
    """The user's profiler; a profiler name becomes one writing into ``logs_dir``."""
    if not isinstance(profiler, str):
        return profiler
    from pytorch_lightning import profilers

    cls = {
        "simple": profilers.SimpleProfiler,
        "advanced": profilers.AdvancedProfiler,
        "pytorch": profilers.PyTorchProfiler,
    }[profiler]
    # Written into the run's logs/ (synced to the store) instead of only printed.
    return cls(dirpath=logs_dir, filename="profile")


#: The ``trainer_args["strategy"]`` values taken: Lightning's DDP names -> find_unused_parameters.
DDP_STRATEGIES = {
    "ddp": False,
    "ddp_find_unused_parameters_false": False,
    "ddp_find_unused_parameters_true": True,
}


def check_strategy(value: object) -> None:
    """Refuse a ``trainer_args["strategy"]`` other than Lightning's DDP names (in the driver)."""
    if value not in DDP_STRATEGIES:
        raise ConfigurationError(
            f"trainer_args['strategy']={value!r} is not supported: LightningEstimator runs "
            f"Lightning's DDP across its Spark tasks; accepted: {sorted(DDP_STRATEGIES)!r} "
            "(ddp_find_unused_parameters_true for a model whose step leaves parameters without "
            "gradients)"
        )


def find_unused_parameters(trainer_args: Mapping[str, object], module: object) -> bool:
    """DDP's ``find_unused_parameters``: the user's strategy name, else by the module.

    A module with ``automatic_optimization = False`` (manual optimization: a GAN's generator
    and discriminator steps, ``toggle_optimizer``) leaves some parameters without gradients in
    each backward; DDP then needs to look for them, so it is on for such modules. Automatic
    optimization keeps DDP's faster default (off).
    """
    name = trainer_args.get("strategy")
    if name is not None:
        return DDP_STRATEGIES[str(name)]
    return getattr(module, "automatic_optimization", True) is False


def trainer_kwargs(
    spec: TrainerSpec,
    use_cuda: bool,
    callbacks: list[pl.Callback],
    train_logger: Logger | list[Logger] | bool,
    profiler: Profiler | None,
    default_root_dir: str,
    find_unused: bool = False,
) -> dict[str, Any]:
    """``pl.Trainer`` keywords: DDP on the Spark ranks, one device each, ``trainer_args`` last."""
    from pytorch_lightning.strategies import DDPStrategy

    from spark_estimators.collective.runtime.settings import collective_timeout
    from spark_estimators.lightning.environment import SparkClusterEnvironment

    env = SparkClusterEnvironment()
    strategy = DDPStrategy(
        cluster_environment=env,
        process_group_backend=_process_group_backend(spec, use_cuda),
        timeout=datetime.timedelta(seconds=collective_timeout()),
        find_unused_parameters=find_unused,
    )
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if use_cuda else "cpu",
        # One device per rank: its own GPU (devices=1 would mean cuda:0, which is another
        # rank's when the host's GPUs are visible, docs/clusters.md "GPUs").
        "devices": [_own_cuda_index()] if use_cuda else 1,
        "num_nodes": env.world_size(),
        "strategy": strategy,
        "max_epochs": spec.epochs,
        "callbacks": callbacks,
        "logger": train_logger,
        "log_every_n_steps": spec.log_every_n_steps,
        "profiler": profiler,
        "accumulate_grad_batches": spec.backward_passes_per_step,
        "num_sanity_val_steps": 0,
        # Our reader shards the data; a DistributedSampler would shard it again.
        "use_distributed_sampler": False,
        "enable_checkpointing": True,
        # The driver shows one progress bar for the whole job.
        "enable_progress_bar": False,
        "enable_model_summary": spec.verbose >= 2,
        "default_root_dir": default_root_dir,
    }
    kwargs.update({k: v for k, v in spec.trainer_args.items() if k != "strategy"})
    return kwargs


class _DropAdvert(logging.Filter):
    """Drops Lightning's "Tip: ... try installing litlogger" line, printed on every fit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_lightning(verbose: int, rank: int) -> None:
    """Keep the ranks' output to what helps: Lightning's info lines on rank 0 with verbose >= 2.

    At ``verbose=1`` (the default) a fit shows only its epoch lines: Lightning's banner ("GPU
    available", "Initializing distributed", the process-group box, "`Trainer.fit` stopped") is a
    notebook's noise, not news (issue 27).
    """
    import warnings

    names = ("pytorch_lightning", "lightning_fabric")
    if verbose < 2 or rank != 0:
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)
    for name in names:
        logging.getLogger(name + ".utilities.rank_zero").addFilter(_DropAdvert())
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates (not user code).
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # Hot-start fills the checkpoint directory on purpose.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def weights_only_resume(
    trainer: pl.Trainer, ckpt_path: str | None, name: str | None
) -> dict[str, Any]:
    """``trainer.fit`` keywords that load the resumed checkpoint (from the store) weights-only.

    pytorch-lightning >= 2.6 takes ``weights_only``; older ones load with ``weights_only=False``,
    so there the file is first checked with a weights-only load of our own.
    """
    import inspect

    if ckpt_path is None:
        return {}
    if "weights_only" in inspect.signature(trainer.fit).parameters:
        return {"weights_only": True}
    from spark_estimators.torch.serialization import load_checkpoint

    load_checkpoint(ckpt_path, map_location="cpu", name=str(name))
    return {}


def best_checkpoint(callbacks: Sequence[object]) -> str | None:
    """The best checkpoint of the user's monitoring ModelCheckpoint, as horovod returned it."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.monitor is not None:
            path = cb.best_model_path
            if path and os.path.exists(path):
                return str(path)
    return None


def logged_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """The trainer's logged metrics that are numbers, as floats."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out
