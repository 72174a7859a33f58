"""The Keras callbacks a ``KerasEstimator`` rank adds to ``model.fit`` (executor side).

:class:`StoreCheckpoint` (rank 0) is the per-epoch checkpoint of the shared rank protocol
(:mod:`spark_estimators.core.rank`): ``checkpoint.keras``, then ``checkpoint.json``, the store
sync of local checkpoint and log directories, and the epoch's logs sent to the driver.
:func:`rank_zero_callbacks` runs the user's file-writing callbacks on rank 0 only, into local
directories that are synced to the store. :func:`restore_checkpoint` loads the store checkpoint
back on hot start (rank 0).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, cast

import keras
import numpy as np

from spark_estimators.core import checkpoint
from spark_estimators.core import rank as protocol
from spark_estimators.keras.serialization import scale_learning_rate
from spark_estimators.store.layout import CHECKPOINT_FILENAME
from spark_estimators.task.scratch import make_temp_dir, scratch_root

if TYPE_CHECKING:
    from spark_estimators.store.base import StoreBase

CHECKPOINT_FILE = CHECKPOINT_FILENAME
FRAMEWORK = "keras"

#: Keras's ``logs`` argument of a callback hook.
Logs = Mapping[str, object] | None


class RunSpec(Protocol):
    """What the callbacks read of ``KerasTrainSpec`` (which imports this module)."""

    store: StoreBase
    run_id: str
    scale_lr: bool


class EpochSetter(Protocol):
    """What :class:`FeedEpochCallback` sets: ``EpochFeed`` (which imports this module)."""

    repeat: bool
    epoch: int


class UserCallbacks(Protocol):
    """The user's callbacks in ``KerasUserObjects`` (which imports this module)."""

    callbacks: list[keras.callbacks.Callback]
    checkpoint_callback: keras.callbacks.ModelCheckpoint | None


def restore_checkpoint(model: keras.Model, spec: RunSpec, size: int) -> None:
    """Load the run's last checkpoint (weights and optimizer state) into ``model``.

    The optimizer state includes the learning rate, scaled for the ranks of the run that saved
    it; with ``scale_lr`` and another number of ranks now (an elastic relaunch with fewer, or a
    hot start with another ``num_proc``) it is re-scaled to ``size``, keeping whatever a
    callback such as ReduceLROnPlateau did to it.
    """
    ckpt = checkpoint_path(spec.store, spec.run_id)
    info = checkpoint.read_info(spec.store, spec.run_id)
    tmp = make_temp_dir("se-keras-restore-")
    try:
        local = os.path.join(tmp, CHECKPOINT_FILE)
        with open(local, "wb") as f:
            f.write(spec.store.read_bytes(ckpt))
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    factor = protocol.lr_rescale(spec.scale_lr, None if info is None else info.num_proc, size)
    if factor != 1.0:
        scale_learning_rate(model.optimizer, factor)


def checkpoint_path(store: StoreBase, run_id: str) -> str:
    """The run's ``checkpoint.keras`` in ``store`` (its info file: core/checkpoint.py)."""
    return checkpoint.store_path(store, run_id, CHECKPOINT_FILE)


class FeedEpochCallback(keras.callbacks.Callback):
    """Tells the training feed which reader epoch the next pass is."""

    def __init__(self, feed: EpochSetter):
        super().__init__()
        self.feed = feed

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        """Set the feed's epoch (unless it repeats: then each pass takes the next one)."""
        if not self.feed.repeat:
            self.feed.epoch = epoch


class FirstBatchEvent(keras.callbacks.Callback):
    """Rank 0: sends the wall-clock time of the end of the first training step to the driver."""

    def __init__(self) -> None:
        super().__init__()
        self.event = protocol.FirstBatchEvent()

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        """Send ``first_batch`` after the first step."""
        self.event()


class StoreCheckpoint(keras.callbacks.Callback):
    """Rank 0: after every epoch, checkpoint, sync logs and report the epoch to the driver.

    Writes ``checkpoint.keras`` (model + optimizer state) atomically, then ``checkpoint.json``
    (last epoch and history), so the info file always names a complete checkpoint. Local
    directories of ``checkpoint_callback`` and ``TensorBoard`` are synced into the run's
    ``checkpoints/`` and ``logs/`` in the store.
    """

    def __init__(
        self,
        spec: RunSpec,
        history: list[dict[str, float]],
        local_dirs: dict[str, str],
        size: int,
    ):
        super().__init__()
        self.spec = spec
        self.history = history
        self.local_dirs = local_dirs
        # The learning rate in the checkpoint is scaled for this many ranks (see _restore).
        self.size = size

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        """Checkpoint, sync the local directories and report the epoch (rank 0)."""
        spec = self.spec
        entry: dict[str, float] = {"epoch": int(epoch)}
        entry.update({k: cast(float, _plain(v)) for k, v in (logs or {}).items()})
        self.history.append(entry)
        ckpt = checkpoint_path(spec.store, spec.run_id)
        with tempfile.TemporaryDirectory(prefix="se-keras-ckpt-", dir=scratch_root()) as tmp:
            local = os.path.join(tmp, CHECKPOINT_FILE)
            self.model.save(local)
            spec.store.upload_file(local, ckpt, atomic=True)
        fingerprint = checkpoint.keras_fingerprint(self.model)
        protocol.commit_epoch(
            spec.store, spec.run_id, FRAMEWORK, int(epoch), self.size, self.history, fingerprint
        )
        from spark_estimators.store.base import CHECKPOINTS_SUBDIR, LOGS_SUBDIR

        for subdir, local_dir in self.local_dirs.items():
            target = CHECKPOINTS_SUBDIR if subdir == "checkpoints" else LOGS_SUBDIR
            spec.store.sync_dir(local_dir, spec.run_id, subdir=target)
        protocol.send_event("epoch", entry)


def moving_statistics(model: keras.Model) -> list[keras.Variable]:
    """The moving mean and variance of every ``BatchNormalization`` layer, nested ones too.

    In layer order (the same on every rank). Horovod returns rank 0's statistics; these are
    what ``average_running_stats=True`` averages.
    """
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False)) if flatten is not None else list(model.layers)
    out: list[keras.Variable] = []
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            out += [layer.moving_mean, layer.moving_variance]
    return out


class AverageRunningStats(keras.callbacks.Callback):
    """At the end of training, average BatchNormalization's moving statistics over the ranks.

    ``KerasEstimator(average_running_stats=True)`` puts it before the user's callbacks, so their
    ``on_train_end`` already sees the averaged values. One allreduce for all of them.
    """

    def on_train_end(self, logs: Logs = None) -> None:
        """Replace each moving statistic by its mean over the ranks (every rank calls it)."""
        from spark_estimators import collective

        variables = moving_statistics(self.model)
        if collective.size() == 1 or not variables:
            return
        arrays = [np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64) for v in variables]
        flat = np.ascontiguousarray(np.concatenate([a.reshape(-1) for a in arrays]))
        collective.allreduce_(flat, op=collective.Average, name="average_running_stats")
        offset = 0
        for v, a in zip(variables, arrays, strict=True):
            v.assign(flat[offset : offset + a.size].reshape(a.shape).astype(v.dtype))
            offset += a.size


def _plain(value: object) -> object:
    """Log values as JSON-friendly Python scalars."""
    if isinstance(value, np.ndarray | np.generic):
        return value.item() if np.ndim(value) == 0 else value.tolist()
    if hasattr(value, "numpy"):
        return _plain(value.numpy())
    return value


def rank_zero_callbacks(
    user: UserCallbacks, rank: int, local_dirs: dict[str, str]
) -> list[keras.callbacks.Callback]:
    """The user's callbacks; file-writing ones run on rank 0 only, into local dirs we sync."""
    out: list[keras.callbacks.Callback] = []
    for cb in user.callbacks:
        if isinstance(cb, keras.callbacks.TensorBoard):
            if rank == 0:
                cb.log_dir = local_dirs.setdefault("logs", make_temp_dir("se-tb-"))
                out.append(cb)
        elif isinstance(cb, keras.callbacks.ModelCheckpoint):
            if rank == 0:
                _redirect(cb, local_dirs)
                out.append(cb)
        else:
            out.append(cb)
    if user.checkpoint_callback is not None and rank == 0:
        _redirect(user.checkpoint_callback, local_dirs)
        out.append(user.checkpoint_callback)
    if rank == 0 and "logs" not in local_dirs:
        # TensorBoard logs of every run, as Horovod's estimator writes them (no graph: it costs
        # seconds per fit and the model summary is in the checkpoint).
        logs_dir = local_dirs.setdefault("logs", make_temp_dir("se-tb-"))
        out.append(keras.callbacks.TensorBoard(logs_dir, write_graph=False))
    return out


def load_checkpoint_callback_weights(model: keras.Model, user: UserCallbacks) -> None:
    """Rank 0: give back the weights ``checkpoint_callback`` saved last (e.g. the best epoch)."""
    cb = user.checkpoint_callback
    path = str(getattr(cb, "filepath", "") or "")
    if cb is None or not os.path.isfile(path):
        return  # never saved, or a per-epoch file name pattern: keep the final weights
    if path.endswith(".weights.h5") or path.endswith(".keras"):
        model.load_weights(path)


def _redirect(cb: keras.callbacks.ModelCheckpoint, local_dirs: dict[str, str]) -> None:
    """Point a ModelCheckpoint at a local dir synced to the run's ``checkpoints/``."""
    local = local_dirs.setdefault("checkpoints", make_temp_dir("se-ckpt-"))
    name = os.path.basename(str(cb.filepath)) or "model.keras"
    if name in (CHECKPOINT_FILE, checkpoint.INFO_FILE):
        name = "user_" + name  # the store checkpoint of the run has that name
    cb.filepath = os.path.join(local, name)
