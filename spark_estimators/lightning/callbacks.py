"""Lightning callbacks used by :class:`LightningEstimator` on the ranks.

``TerminateOnNaN`` is public (``terminate_on_nan=True`` adds it; Lightning 2.x removed the Trainer
argument). ``StoreCheckpoint`` is the estimator's own checkpoint: it records the rank-averaged
metrics of every epoch, saves ``last_epoch.ckpt`` through Lightning's ``ModelCheckpoint`` (every
rank takes part in its collectives; only rank 0 writes) and, on rank 0, copies the checkpoint
and log directories into the store and reports the epoch to the driver.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from spark_estimators.core import checkpoint
from spark_estimators.core.rank import commit_epoch, send_event

if TYPE_CHECKING:
    from pytorch_lightning.utilities.types import STEP_OUTPUT

    from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)

#: Name (without ``.ckpt``) of the checkpoint a hot-start resumes from.
LAST_CHECKPOINT = "last_epoch"
CHECKPOINT_SUFFIX = ".ckpt"
FRAMEWORK = "lightning"


def _step_loss(outputs: object) -> torch.Tensor | None:
    """The loss a ``training_step`` returned (a tensor or a dict with ``"loss"``), if any."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    return None


class TerminateOnNaN(Callback):
    """Stop training with an error as soon as the loss or a parameter is NaN or infinite.

    Lightning 1.x's ``Trainer(terminate_on_nan=True)`` as a callback. Under DDP the gradients are
    averaged, so a NaN on one rank reaches every rank's parameters at the same step; the rank that
    raises first fails the job and the launcher stops the others.
    """

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        """Raise naming the epoch, batch and rank when the step's loss is not finite."""
        loss = _step_loss(outputs)
        where = f"epoch {trainer.current_epoch}, batch {batch_idx}, rank {trainer.global_rank}"
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"the training loss is {float(loss.detach())} at {where}; terminate_on_nan=True "
                "stopped training (lower the learning rate or check the data)"
            )
        for name, param in pl_module.named_parameters():
            if not bool(torch.isfinite(param.detach()).all()):
                raise ValueError(
                    f"parameter {name!r} holds NaN or infinite values at {where}; "
                    "terminate_on_nan=True stopped training"
                )


class AverageRunningStats(Callback):
    """At the end of training, average BatchNorm running statistics over the ranks.

    ``LightningEstimator(average_running_stats=True)`` puts it first, so the user's
    ``on_train_end`` hooks already see the averaged statistics
    (:mod:`spark_estimators.torch.running_stats`).
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Average the statistics in one allreduce per dtype (every rank calls it)."""
        from spark_estimators.torch.running_stats import average_running_stats

        def allreduce_sum_(flat: torch.Tensor) -> None:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(flat)

        average_running_stats(pl_module, allreduce_sum_, int(trainer.world_size))


class StoreCheckpoint(ModelCheckpoint):
    """The estimator's per-epoch checkpoint, history and store sync (see the module docstring).

    Parameters
    ----------
    local_dir
        Local directory of the checkpoints (rank 0's path is broadcast by Lightning).
    logs_dir
        Local directory of the logger's files, synced to the run's ``logs/`` by rank 0.
    store
        The store view (``Store.to_remote()``) of the run.
    run_id
        The run.
    history
        Epochs already done (hot-start); replaced by the checkpoint's own on restore.
    """

    def __init__(
        self,
        local_dir: str,
        logs_dir: str,
        store: StoreBase,
        run_id: str,
        history: list[dict[str, float]] | None = None,
    ) -> None:
        super().__init__(
            dirpath=local_dir,
            filename=LAST_CHECKPOINT,
            monitor=None,
            save_top_k=1,
            save_on_train_epoch_end=True,
            enable_version_counter=False,
        )
        self.logs_dir = logs_dir
        self.store = store
        self.run_id = run_id
        self.history: list[dict[str, float]] = list(history or [])
        self._loss_sum = 0.0
        self._loss_steps = 0

    @property
    def state_key(self) -> str:
        """A key distinct from any ``ModelCheckpoint`` the user adds."""
        # Distinct from any ModelCheckpoint the user adds (Lightning refuses duplicate keys).
        return "spark_estimators.StoreCheckpoint"

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint callback's state plus the metric history."""
        state = super().state_dict()
        state["history"] = list(self.history)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the checkpoint callback's state and the metric history."""
        super().load_state_dict(state_dict)
        self.history = list(state_dict.get("history", self.history))

    # -- metrics ---------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Reset the epoch's running loss."""
        self._loss_sum, self._loss_steps = 0.0, 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
    ) -> None:
        """Add the step's loss to the epoch's running sum."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        loss = _step_loss(outputs)
        if loss is not None:
            # Automatic optimization hands hooks the loss divided by accumulate_grad_batches.
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._loss_sum += float(loss.detach()) * scale
            self._loss_steps += 1

    def _epoch_logs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """The epoch's metrics averaged over the ranks (a collective: every rank calls it)."""
        local: dict[str, float] = {}
        for key, value in trainer.callback_metrics.items():
            scalar_tensor = isinstance(value, torch.Tensor) and value.numel() == 1
            if scalar_tensor or isinstance(value, int | float):
                local[key] = float(value)
        if self._loss_steps and "loss" not in local:
            local["loss"] = self._loss_sum / self._loss_steps
        # Rank 0's names decide, so every rank reduces the same vector.
        keys: list[str] = trainer.strategy.broadcast(sorted(local))
        if not keys:
            return {"epoch": trainer.current_epoch}
        values = torch.tensor(
            [local.get(k, math.nan) for k in keys], dtype=torch.float64, device=pl_module.device
        )
        if trainer.world_size > 1:
            values = trainer.strategy.reduce(values, reduce_op="mean")
        logs: dict[str, float] = {"epoch": trainer.current_epoch}
        logs.update({k: float(v) for k, v in zip(keys, values.cpu().tolist(), strict=True)})
        return logs

    # -- epoch end: after validation, EarlyStopping and the user's checkpoints ------------------
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the epoch's metrics, checkpoint; rank 0 publishes them to store and driver."""
        logs = self._epoch_logs(trainer, pl_module)
        self.history.append(logs)
        super().on_train_epoch_end(trainer, pl_module)
        if trainer.is_global_zero:
            self.publish(
                trainer.current_epoch,
                num_proc=trainer.world_size,
                fingerprint=checkpoint.torch_fingerprint(pl_module),
            )
            send_event("epoch", logs)

    def publish(
        self, epoch: int | None, num_proc: int | None = None, fingerprint: str | None = None
    ) -> None:
        """Copy checkpoints and logs into the store (rank 0); ``epoch`` also updates the info."""
        store, run_id = self.store, self.run_id
        local = str(self.dirpath)
        if os.path.isdir(local):
            store.sync_dir(local, run_id, subdir="checkpoints")
            self._mirror_deletions(local)
        if os.path.isdir(self.logs_dir):
            store.sync_dir(self.logs_dir, run_id, subdir="logs")
        if epoch is None:
            return
        # Written last: an info file always names a complete checkpoint.
        extra = {"checkpoint": LAST_CHECKPOINT + CHECKPOINT_SUFFIX}
        commit_epoch(store, run_id, FRAMEWORK, epoch, num_proc, self.history, fingerprint, extra)

    def _mirror_deletions(self, local_dir: str) -> None:
        """Delete store checkpoints that ModelCheckpoint removed locally (its top-k pruning)."""
        base = checkpoint.store_path(self.store, self.run_id)
        present = set(os.listdir(local_dir))
        for name in self.store.listdir(base):
            if name.endswith(CHECKPOINT_SUFFIX) and name not in present:
                logger.debug("removing pruned checkpoint %s from the store", name)
                self.store.delete(checkpoint.store_path(self.store, self.run_id, name))
