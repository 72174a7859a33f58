"""What every rank runs for ``LightningEstimator.fit`` (executor side; module-level, no closures).

Per rank: build Lightning's standard ``DDPStrategy`` on :class:`SparkClusterEnvironment`
(``devices=1, num_nodes=world_size``: each rank process drives one device), open this rank's
shard of the prepared data with our reader (every rank gets the same number of batches, so no
rank leaves a collective early), and run ``Trainer.fit`` with the user's ``LightningModule``,
callbacks and logger. Batches reach ``training_step`` as ``{column: tensor}`` dicts
(see :class:`BatchConverter`). :class:`~spark_estimators.lightning.callbacks.StoreCheckpoint`
records the rank-averaged metrics, checkpoints every epoch and copies checkpoints and logs into
the store; on hot-start every rank passes the run's last checkpoint as ``ckpt_path``.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators.core import checkpoint, tensors
from spark_estimators.core.spec import TrainSpec
from spark_estimators.task.scratch import make_temp_dir, remove_at_rank_exit

logger = logging.getLogger(__name__)

_PROFILERS = ("simple", "advanced", "pytorch")


@dataclass(kw_only=True)
class LightningTrainSpec(TrainSpec):
    """Everything a rank needs; user objects travel pickled in ``user_blob``."""

    num_gpus: int | None
    collective_backend: str
    backward_passes_per_step: int
    log_every_n_steps: int
    trainer_args: dict[str, Any]
    terminate_on_nan: bool
    verbose: int
    checkpoint_file: str | None = None


@dataclass
class LightningUserObjects:
    """The user's objects, pickled together (callbacks may refer to the module)."""

    model: Any
    callbacks: list[Any]
    logger: Any = None
    profiler: Any = None
    transformation_fn: Any = None


class BatchConverter:
    """Reader batches (dicts of numpy arrays) -> the dicts of tensors ``training_step`` gets.

    As horovod's Lightning estimator delivered them: one entry per feature, label (and sample
    weight) column, keyed by column name; a scalar column is ``[batch]``, an array or vector
    column ``[batch, n]``; ``input_shapes`` / ``label_shapes`` reshape them by the rule of
    :func:`spark_estimators.core.tensors.shape_column` (Horovod's ``[-1, 1, 28, 28]`` is the
    whole batch's shape, a shape without the leading ``-1`` a per-row one), so training sees the
    tensors ``transform`` feeds.
    Floats become float32, integers int64 (as in :mod:`spark_estimators.core.tensors`).
    """

    def __init__(
        self,
        feature_cols: list[str],
        label_cols: list[str],
        sample_weight_col: str | None,
        input_shapes: list[Any] | None,
        label_shapes: list[Any] | None,
    ) -> None:
        self.columns: list[tuple[str, Any]] = []
        for cols, shapes in ((feature_cols, input_shapes), (label_cols, label_shapes)):
            for i, col in enumerate(cols):
                self.columns.append((col, None if shapes is None else shapes[i]))
        self.sample_weight_col = sample_weight_col

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for col, shape in self.columns:
            values = tensors.as_model_array(np.asarray(arrays[col]))
            # The rule of TorchEstimator and transform(): [-1, ...] is the full shape.
            values = tensors.shape_column(values, shape, scalar_as_column=False)
            out[col] = torch.from_numpy(tensors.for_torch(values))
        if self.sample_weight_col:
            weights = np.asarray(arrays[self.sample_weight_col], dtype=np.float32)
            out[self.sample_weight_col] = torch.from_numpy(tensors.for_torch(weights))
        return out


class ReaderLoader:
    """A Lightning dataloader over one split of this rank's shard: ``steps`` batches per epoch.

    ``iter()`` starts the epoch lazily (Lightning calls ``iter`` once just to check the object),
    shuffling for the epoch ``epoch_fn()`` returns, and stops the reader's prefetch thread when an
    epoch ends early (EarlyStopping, ``limit_train_batches``).
    """

    def __init__(
        self,
        reader: Any,
        steps: int,
        convert: Callable[[dict[str, np.ndarray]], dict[str, Any]],
        epoch_fn: Callable[[], int] | None = None,
    ) -> None:
        self.reader, self.steps, self.convert, self.epoch_fn = reader, steps, convert, epoch_fn

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.epoch_fn is not None:
            self.reader.set_epoch(self.epoch_fn())
        iterator = iter(self.reader)
        try:
            for _ in range(self.steps):
                yield self.convert(next(iterator))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


def _open_reader(spec: LightningTrainSpec, split: str, transformation_fn: Any) -> Any:
    return spec.open_reader(
        split,
        int(os.environ.get(ev.SE_RANK, "0")),
        int(os.environ.get(ev.SE_SIZE, "1")),
        transformation_fn,
    )


def _use_cuda(spec: LightningTrainSpec) -> bool:
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


def _process_group_backend(spec: LightningTrainSpec, use_cuda: bool) -> str:
    if spec.collective_backend == "auto":
        return "nccl" if use_cuda else "gloo"
    if spec.collective_backend == "nccl" and not use_cuda:
        raise RuntimeError("collective_backend='nccl' needs a GPU on every rank; use 'auto'")
    return spec.collective_backend


def _make_logger(user_logger: Any, logs_dir: str) -> Any:
    if user_logger is not None:
        return user_logger  # a logger the user configured, or False for none
    # tensorboard imports TensorFlow for file I/O when it is installed (seconds of start-up in
    # every rank); its marker module makes it use its own light stub instead.
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
    try:
        from pytorch_lightning.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=logs_dir, name="", version="", default_hp_metric=False)
    except ModuleNotFoundError:
        logger.warning("tensorboard is not installed: no TensorBoard logs for this run")
        return False


def _make_profiler(profiler: Any, logs_dir: str) -> Any:
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


def _local_checkpoint_dir(spec: LightningTrainSpec, rank: int) -> str:
    """Rank 0's checkpoint dir: the same path on every attempt of a run, holding its checkpoints.

    A stable path lets ``ModelCheckpoint`` restore its best-k bookkeeping on hot-start (it only
    does so when its ``dirpath`` is unchanged); the store's checkpoints are copied back into it.
    """
    if rank != 0:
        return make_temp_dir("se-lightning-ckpt-")
    path = os.path.join(tempfile.gettempdir(), f"spark_estimators-lightning-{spec.run_id}")
    remove_at_rank_exit(path)  # outside the scratch dir, so registered: gone even if killed
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _fetch_checkpoints(spec: LightningTrainSpec, rank: int, local_dir: str) -> str | None:
    """On hot-start: the local path of the checkpoint to resume from (rank 0 fetches them all)."""
    if spec.checkpoint_file is None:
        return None
    store = spec.store
    base = store.get_checkpoint_path(spec.run_id).rstrip("/")
    names = [spec.checkpoint_file]
    if rank == 0:
        names += [
            n for n in store.listdir(base) if n.endswith(".ckpt") and n != spec.checkpoint_file
        ]
    for name in names:
        store.download_file(base + "/" + name, os.path.join(local_dir, name))
    return os.path.join(local_dir, spec.checkpoint_file)


def _trainer_kwargs(
    spec: LightningTrainSpec,
    use_cuda: bool,
    callbacks: list[Any],
    train_logger: Any,
    profiler: Any,
    default_root_dir: str,
) -> dict[str, Any]:
    from pytorch_lightning.strategies import DDPStrategy

    from spark_estimators.collective.runtime.settings import collective_timeout
    from spark_estimators.lightning.environment import SparkClusterEnvironment

    env = SparkClusterEnvironment()
    strategy = DDPStrategy(
        cluster_environment=env,
        process_group_backend=_process_group_backend(spec, use_cuda),
        timeout=datetime.timedelta(seconds=collective_timeout()),
    )
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if use_cuda else "cpu",
        "devices": 1,
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
    kwargs.update(spec.trainer_args)
    return kwargs


def train(spec: LightningTrainSpec) -> dict[str, Any]:
    """Fit on this rank; rank 0 returns weights, history and metrics, every rank a fingerprint."""
    import cloudpickle
    import pytorch_lightning as pl

    rank = int(os.environ.get(ev.SE_RANK, "0"))
    _quiet_lightning(spec.verbose, rank)
    if spec.seed is not None:
        pl.seed_everything(spec.seed, verbose=False)
    user: LightningUserObjects = cloudpickle.loads(spec.user_blob)
    module = user.model
    use_cuda = _use_cuda(spec)

    run_dir = make_temp_dir("se-lightning-run-")
    ckpt_dir: str | None = None
    try:
        ckpt_dir = _local_checkpoint_dir(spec, rank)
        return _fit(spec, rank, user, module, use_cuda, run_dir, ckpt_dir)
    finally:
        # Everything worth keeping is in the store now (or the fit failed).
        for local in (ckpt_dir, run_dir):
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)


def _fit(
    spec: LightningTrainSpec,
    rank: int,
    user: LightningUserObjects,
    module: Any,
    use_cuda: bool,
    run_dir: str,
    ckpt_dir: str,
) -> dict[str, Any]:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    from spark_estimators.lightning.callbacks import StoreCheckpoint, TerminateOnNaN
    from spark_estimators.torch.serialization import load_checkpoint

    logs_dir = os.path.join(run_dir, "logs")
    os.makedirs(logs_dir)
    ckpt_path = _fetch_checkpoints(spec, rank, ckpt_dir)

    callbacks = list(user.callbacks)
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
            cb.dirpath = ckpt_dir  # the user's checkpoints go to the store too
    if spec.terminate_on_nan:
        callbacks.append(TerminateOnNaN())
    store_ckpt = StoreCheckpoint(ckpt_dir, logs_dir, spec.store, spec.run_id, spec.history)
    callbacks.append(store_ckpt)

    trainer = pl.Trainer(
        **_trainer_kwargs(
            spec,
            use_cuda,
            callbacks,
            _make_logger(user.logger, logs_dir),
            _make_profiler(user.profiler, logs_dir),
            run_dir,
        )
    )
    convert = BatchConverter(
        spec.feature_cols,
        spec.label_cols,
        spec.sample_weight_col,
        spec.input_shapes,
        spec.label_shapes,
    )
    train_reader = _open_reader(spec, "train", user.transformation_fn)
    train_loader = ReaderLoader(
        train_reader,
        checkpoint.epoch_steps(train_reader, spec.train_steps_per_epoch),
        convert,
        epoch_fn=lambda: trainer.current_epoch,
    )
    val_loader = None
    if spec.meta.has_val:
        val_reader = _open_reader(spec, "val", user.transformation_fn)
        val_loader = ReaderLoader(
            val_reader, checkpoint.epoch_steps(val_reader, spec.validation_steps_per_epoch), convert
        )
    trainer.fit(
        module,
        train_dataloaders=train_loader,
        val_dataloaders=val_loader,
        ckpt_path=ckpt_path,
        **_weights_only_resume(trainer, ckpt_path, spec.checkpoint_file),
    )

    result: dict[str, Any] = {"rank": rank, "fingerprint": checkpoint.torch_fingerprint(module)}
    if rank == 0:
        store_ckpt.publish(None)  # files written after the last epoch (profiler, logger close)
        module = module.cpu()
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        best = _best_checkpoint(user.callbacks)
        if best is not None:
            state = load_checkpoint(best, map_location="cpu", name=best)["state_dict"]
        shapes, forward_error = _output_shapes(module, train_reader, spec)
        result.update(
            state_dict=state,
            history=store_ckpt.history,
            logged_metrics=_floats(trainer.logged_metrics),
            output_shapes=shapes,
            forward_error=forward_error,
            best_model_path=None if best is None else os.path.basename(best),
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


class _DropAdvert(logging.Filter):
    """Drops Lightning's "Tip: ... try installing litlogger" line, printed on every fit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def _quiet_lightning(verbose: int, rank: int) -> None:
    """Keep the ranks' output to what helps: Lightning's info lines on rank 0 with verbose >= 1."""
    import warnings

    names = ("pytorch_lightning", "lightning_fabric")
    if verbose < 1 or rank != 0:
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)
    for name in names:
        logging.getLogger(name + ".utilities.rank_zero").addFilter(_DropAdvert())
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates (not user code).
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # Hot-start fills the checkpoint directory on purpose.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def _weights_only_resume(trainer: Any, ckpt_path: str | None, name: str | None) -> dict[str, Any]:
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


def _best_checkpoint(callbacks: list[Any]) -> str | None:
    """The best checkpoint of the user's monitoring ModelCheckpoint, as horovod returned it."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.monitor is not None:
            path = cb.best_model_path
            if path and os.path.exists(path):
                return str(path)
    return None


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _output_shapes(
    module: Any, reader: Any, spec: LightningTrainSpec
) -> tuple[list[tuple[int, ...]], str | None]:
    """Per-row output shapes of ``module(*features)`` (how ``transform`` calls it), or the error."""
    import torch

    module.eval()
    arrays = tensors.model_inputs(reader.peek(), spec.feature_cols, spec.input_shapes)
    inputs = [torch.from_numpy(tensors.for_torch(a)) for a in arrays]
    try:
        with torch.no_grad():
            out = module(*inputs)
    except Exception as exc:  # reported by transform(), not a failed fit
        return [], f"{type(exc).__name__}: {exc}"
    outs = list(out) if isinstance(out, list | tuple) else [out]
    shapes = [tensors.output_row_shape(o.detach().cpu().numpy()) for o in outs]
    return shapes, None
