"""What every rank runs for ``LightningEstimator.fit`` (executor side; module-level, no closures).

Per rank: build Lightning's ``Trainer`` with DDP on the Spark ranks
(:mod:`spark_estimators.lightning.trainer`), open this rank's shard of the prepared data with
our reader (every rank gets the same number of batches, so no rank leaves a collective early),
and run ``Trainer.fit`` with the user's ``LightningModule``, callbacks and logger. Batches reach
``training_step`` as ``{column: tensor}`` dicts made by the shared
:class:`~spark_estimators.core.batches.BatchConverter` (Horovod's Lightning layout: a scalar
column is ``[batch]``; ``input_shapes`` by the rule ``transform`` uses), converted in the reader's
prefetch thread. :class:`~spark_estimators.lightning.callbacks.StoreCheckpoint` records the
rank-averaged metrics, checkpoints every epoch and copies checkpoints and logs into the store; on
hot-start every rank passes the run's last checkpoint as ``ckpt_path``. The result dict and the
steps per epoch follow :mod:`spark_estimators.core.rank`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spark_estimators.core import checkpoint, tensors
from spark_estimators.core import rank as protocol
from spark_estimators.core.batches import BatchConverter, epoch_batches
from spark_estimators.core.spec import TrainSpec
from spark_estimators.task.scratch import make_temp_dir, remove_at_rank_exit

if TYPE_CHECKING:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.loggers import Logger
    from pytorch_lightning.profilers import Profiler

    from spark_estimators.core.rank import RankReader


@dataclass(kw_only=True)
class LightningTrainSpec(TrainSpec):
    """Everything a rank needs; user objects travel pickled in ``user_blob``."""

    num_gpus: int | None
    collective_backend: str
    backward_passes_per_step: int
    log_every_n_steps: int
    trainer_args: dict[str, object]
    terminate_on_nan: bool
    verbose: int
    checkpoint_file: str | None = None


@dataclass
class LightningUserObjects:
    """The user's objects, pickled together (callbacks may refer to the module)."""

    model: pl.LightningModule
    callbacks: list[pl.Callback]
    logger: Logger | list[Logger] | bool | None = None
    profiler: Profiler | str | None = None
    transformation_fn: Callable[..., object] | None = None


def converter(spec: LightningTrainSpec) -> BatchConverter:
    """Lightning batches: every scalar column ``[batch]``, as horovod's estimator gave them."""
    return BatchConverter.for_spec(spec, scalar_features_as_column=False)


class ReaderLoader:
    """A Lightning dataloader over one split of this rank's shard: ``steps`` batches per epoch.

    ``iter()`` starts the epoch lazily (Lightning calls ``iter`` once just to check the object),
    shuffling for the epoch ``epoch_fn()`` returns, and stops the reader's prefetch thread when an
    epoch ends early (EarlyStopping, ``limit_train_batches``).
    """

    def __init__(
        self,
        reader: RankReader,
        steps: int | None,
        convert: BatchConverter,
        epoch_fn: Callable[[], int] | None = None,
    ) -> None:
        self.reader, self.steps, self.convert, self.epoch_fn = reader, steps, convert, epoch_fn

    def __len__(self) -> int:
        if self.steps is None:
            # data="stream": the reader ends each epoch at the count the ranks agree on. Never
            # sized on one rank only: Lightning reduces the lengths of sized loaders (a
            # collective), so a length known on some ranks only hung DDP (issue 29).
            raise TypeError("the number of batches per epoch is not known (data='stream')")
        return self.steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = None if self.epoch_fn is None else self.epoch_fn()
        return epoch_batches(self.reader, self.convert, self.steps, epoch)


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
    base = checkpoint.store_path(store, spec.run_id)
    names = [spec.checkpoint_file]
    if rank == 0:
        names += [
            n for n in store.listdir(base) if n.endswith(".ckpt") and n != spec.checkpoint_file
        ]
    for name in names:
        store.download_file(
            checkpoint.store_path(store, spec.run_id, name), os.path.join(local_dir, name)
        )
    return os.path.join(local_dir, spec.checkpoint_file)


def train(spec: LightningTrainSpec) -> dict[str, object]:
    """Fit on this rank; rank 0 returns weights, history and metrics, every rank a fingerprint."""
    import cloudpickle
    import pytorch_lightning as pl

    from spark_estimators.lightning.trainer import quiet_lightning, rank_uses_cuda

    rank, _ = protocol.rank_and_size()
    protocol.size_torch_threads(protocol.local_size())
    quiet_lightning(spec.verbose, rank)
    if spec.seed is not None:
        pl.seed_everything(spec.seed, verbose=False)
    user: LightningUserObjects = cloudpickle.loads(spec.user_blob)
    module = user.model
    use_cuda = rank_uses_cuda(spec)

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
    module: pl.LightningModule,
    use_cuda: bool,
    run_dir: str,
    ckpt_dir: str,
) -> dict[str, object]:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    from spark_estimators.lightning import trainer as setup
    from spark_estimators.lightning.callbacks import (
        AverageRunningStats,
        StoreCheckpoint,
        TerminateOnNaN,
    )
    from spark_estimators.torch.serialization import load_checkpoint

    logs_dir = os.path.join(run_dir, "logs")
    os.makedirs(logs_dir)
    ckpt_path = _fetch_checkpoints(spec, rank, ckpt_dir)

    callbacks = list(user.callbacks)
    if spec.average_running_stats:
        callbacks.insert(0, AverageRunningStats())  # before the user's on_train_end
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
            cb.dirpath = ckpt_dir  # the user's checkpoints go to the store too
    if spec.terminate_on_nan:
        callbacks.append(TerminateOnNaN())
    store_ckpt = StoreCheckpoint(ckpt_dir, logs_dir, spec.store, spec.run_id, spec.history)
    callbacks.append(store_ckpt)

    trainer = pl.Trainer(
        **setup.trainer_kwargs(
            spec,
            use_cuda,
            callbacks,
            setup.make_logger(user.logger, logs_dir),
            setup.make_profiler(user.profiler, logs_dir),
            run_dir,
            setup.find_unused_parameters(spec.trainer_args, module),
        )
    )
    convert = converter(spec)
    size = protocol.rank_and_size()[1]
    train_reader, val_reader = protocol.open_readers(spec, rank, size, user.transformation_fn)
    train_loader = ReaderLoader(
        train_reader,
        protocol.epoch_steps(train_reader, spec.train_steps_per_epoch),
        convert,
        epoch_fn=lambda: trainer.current_epoch,
    )
    val_loader = None
    if val_reader is not None:
        val_steps = protocol.epoch_steps(val_reader, spec.validation_steps_per_epoch)
        val_loader = ReaderLoader(val_reader, val_steps, convert)
    trainer.fit(
        module,
        train_dataloaders=train_loader,
        val_dataloaders=val_loader,
        ckpt_path=ckpt_path,
        **setup.weights_only_resume(trainer, ckpt_path, spec.checkpoint_file),
    )

    fingerprint = checkpoint.torch_fingerprint(module)
    history, shapes, payload = None, None, {}
    if rank == 0:
        store_ckpt.publish(None)  # files written after the last epoch (profiler, logger close)
        module = module.cpu()
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        best = setup.best_checkpoint(user.callbacks)
        if best is not None:
            state = load_checkpoint(best, map_location="cpu", name=best)["state_dict"]
        shapes, forward_error = _output_shapes(module, train_reader, spec)
        history = store_ckpt.history
        payload = {
            "state_dict": state,
            "logged_metrics": setup.logged_floats(trainer.logged_metrics),
            "forward_error": forward_error,
            "best_model_path": None if best is None else os.path.basename(best),
        }
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return protocol.rank_result(rank, fingerprint, history, shapes, **payload)


def _output_shapes(
    module: pl.LightningModule, reader: RankReader, spec: LightningTrainSpec
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
    return protocol.row_shapes(out), None
