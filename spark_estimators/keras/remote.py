"""What every rank runs for ``KerasEstimator.fit`` (executor side; module-level, no closures).

Per rank: quiet TensorFlow and size its thread pools to this rank's share of the cores, init the
collective group, rebuild the user's model (``.keras`` bytes, ``custom_objects`` in scope) and
optimizer, scale the learning rate by the number of ranks (Horovod's rule; ``scale_lr=False``
keeps it), wrap the optimizer in :func:`~spark_estimators.collective.keras.DistributedOptimizer`,
compile with the user's loss, metrics and loss weights (``jit_compile=False``), restore the last
checkpoint on hot-start, and run the real ``model.fit`` on the sharded reader as ``tf.data``
(every rank runs the same number of steps). Callback order, which is what makes the ranks agree:

1. ``BroadcastGlobalVariablesCallback(0)``: rank 0's model and optimizer state everywhere;
2. ``MetricAverageCallback``: each epoch's logs become the mean over the ranks;
3. the user's callbacks (``ModelCheckpoint`` and ``TensorBoard`` only on rank 0, writing into
   the run's directory in the store), then ``checkpoint_callback`` on rank 0;
4. ``StopTrainingAgreement``: a rank stops after an epoch only together with the others;
5. rank 0: the store checkpoint (``checkpoint.keras`` + ``checkpoint.json``), TensorBoard sync
   and the epoch's metrics sent to the driver.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from spark_estimators import envvars

if os.environ.get(envvars.SE_RANK) is not None:
    # A rank process: quiet TensorFlow's C++ logging before the first import of TensorFlow.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from spark_estimators.core import checkpoint, tensors
from spark_estimators.core.spec import TrainSpec  # noqa: E402
from spark_estimators.task.scratch import make_temp_dir, scratch_root  # noqa: E402

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.keras"
FRAMEWORK = "keras"


@dataclass(kw_only=True)
class KerasTrainSpec(TrainSpec):
    """Everything a rank needs. User objects travel pickled; the model as ``.keras`` bytes."""

    model_bytes: bytes
    custom_objects_blob: bytes
    loss_weights: list[float] | None
    compression: str
    scale_lr: bool
    verbose: int


@dataclass
class KerasUserObjects:
    """Objects unpickled inside ``custom_object_scope`` (Keras objects may need it)."""

    optimizer_recipe: Any
    loss: Any
    metrics: Any
    callbacks: list[Any]
    checkpoint_callback: Any = None
    transformation_fn: Any = None


# -- (de)serialization shared with the driver ----------------------------------------------------
def model_to_bytes(model: Any) -> bytes:
    """The model as ``.keras`` archive bytes."""
    tmp = make_temp_dir("se-keras-")
    try:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_from_bytes(
    data: bytes, custom_objects: dict[str, Any] | None, compile: bool = True
) -> Any:
    """Load ``.keras`` bytes; ``safe_mode`` is off because the model is the user's own."""
    tmp = make_temp_dir("se-keras-")
    try:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(
            path, custom_objects=custom_objects or None, compile=compile, safe_mode=False
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def optimizer_recipe(optimizer: Any) -> tuple[type, dict[str, Any]]:
    """``(class, config)`` that rebuilds ``optimizer`` (fresh state) with ``cls.from_config``.

    Schedules and wrapped optimizers stay objects (pickled), so custom ones need no
    ``custom_objects``.
    """
    config = dict(optimizer.get_config())
    lr = getattr(optimizer, "_learning_rate", None)
    if lr is not None and "learning_rate" in config and not hasattr(lr, "assign"):
        config["learning_rate"] = lr
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and "inner_optimizer" in config:
        config["inner_optimizer"] = ("__recipe__", optimizer_recipe(inner))
    return type(optimizer), config


def optimizer_from_recipe(recipe: tuple[Any, dict[str, Any]]) -> Any:
    cls, config = recipe
    config = dict(config)
    inner = config.get("inner_optimizer")
    if isinstance(inner, tuple) and inner and inner[0] == "__recipe__":
        config.pop("inner_optimizer")
        return cls(optimizer_from_recipe(inner[1]), **config)  # LossScaleOptimizer
    return cls.from_config(config)


def checkpoint_path(store: Any, run_id: str) -> str:
    """The run's ``checkpoint.keras`` in ``store`` (its info file: core/checkpoint.py)."""
    return store.get_checkpoint_path(run_id).rstrip("/") + "/" + CHECKPOINT_FILE


# -- rank setup ----------------------------------------------------------------------------------
def _size_tensorflow(local_size: int, use_gpu: bool | None) -> None:
    import tensorflow as tf

    # Each rank gets its share of the host's cores: N ranks x all cores oversubscribes the CPU.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, int(cores or 1) // max(1, local_size))
    if not os.environ.get("OMP_NUM_THREADS"):
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    if use_gpu is False:
        tf.config.set_visible_devices([], "GPU")


def scale_learning_rate(optimizer: Any, factor: float) -> None:
    """Multiply the optimizer's learning rate variable by ``factor`` (in place)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    lr = target._learning_rate
    if not hasattr(lr, "assign"):
        raise TypeError("scale_lr needs a constant learning rate, not a schedule")
    lr.assign(lr * factor)


# -- data ----------------------------------------------------------------------------------------
class EpochFeed:
    """A reader view for :func:`spark_estimators.data.tf_dataset`: model-ready arrays.

    Columns follow :mod:`spark_estimators.core.tensors` (float32, scalars ``[n, 1]``, shapes from
    ``input_shapes``/``label_shapes``), exactly what ``transform`` feeds the model. The reader
    epoch of each pass is set by the fit loop (:class:`FeedEpochCallback`), so Keras's extra
    look at the first batch before training does not shift the shuffling; with ``repeat`` (fixed
    steps per epoch) each pass takes the next reader epoch instead.
    """

    def __init__(self, reader: Any, spec: KerasTrainSpec, start_epoch: int, repeat: bool):
        self.reader = reader
        self.spec = spec
        self.batch_size = reader.batch_size
        self.steps_per_epoch = reader.steps_per_epoch
        self.epoch = start_epoch
        self.repeat = repeat

    def _convert(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.spec
        out: dict[str, np.ndarray] = {}
        for cols, shapes in (
            (spec.feature_cols, spec.input_shapes),
            (spec.label_cols, spec.label_shapes),
        ):
            for col, arr in zip(cols, tensors.model_inputs(batch, cols, shapes), strict=True):
                out[col] = np.ascontiguousarray(arr)
        if spec.sample_weight_col:
            w = np.asarray(batch[spec.sample_weight_col], dtype=np.float32)
            out[spec.sample_weight_col] = w.reshape(-1)
        return out

    def peek(self) -> dict[str, np.ndarray]:
        return self._convert(self.reader.peek())

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.reader.set_epoch(self.epoch)
        if self.repeat:
            self.epoch += 1
        iter_epoch = getattr(self.reader, "iter_epoch", None)
        if iter_epoch is not None:
            from spark_estimators.data.reader import BlockFormat

            # Whole decoded blocks are converted in the reader's prefetch thread; batches are
            # slices of them.
            iterator = iter_epoch(BlockFormat(convert=self._convert, concat=np.concatenate))
        else:  # readers without blocks (petastorm): convert each batch
            iterator = (self._convert(batch) for batch in self.reader)
        try:
            yield from iterator
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


def make_dataset(feed: EpochFeed, spec: KerasTrainSpec) -> Any:
    from spark_estimators.data import tf_dataset

    ds = tf_dataset(feed, spec.feature_cols, spec.label_cols, spec.sample_weight_col)
    return ds.repeat() if feed.repeat else ds


def _steps(reader: Any, limit: int | None) -> tuple[int | None, bool]:
    """Keras ``steps_per_epoch`` and whether the dataset must repeat to provide them."""
    if limit is None or int(limit) >= int(reader.steps_per_epoch):
        return None, False
    return int(limit), True


# -- rank-side callbacks -------------------------------------------------------------------------
class FeedEpochCallback(keras.callbacks.Callback):
    """Tells the training feed which reader epoch the next pass is."""

    def __init__(self, feed: EpochFeed):
        super().__init__()
        self.feed = feed

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.feed.repeat:
            self.feed.epoch = epoch


class FirstBatchEvent(keras.callbacks.Callback):
    """Rank 0: sends the wall-clock time of the end of the first training step to the driver."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.sent:
            self.sent = True
            send_event("first_batch", time.time())


class StoreCheckpoint(keras.callbacks.Callback):
    """Rank 0: after every epoch, checkpoint, sync logs and report the epoch to the driver.

    Writes ``checkpoint.keras`` (model + optimizer state) atomically, then ``checkpoint.json``
    (last epoch and history), so the info file always names a complete checkpoint. Local
    directories of ``checkpoint_callback`` and ``TensorBoard`` are synced into the run's
    ``checkpoints/`` and ``logs/`` in the store.
    """

    def __init__(
        self,
        spec: KerasTrainSpec,
        history: list[dict[str, Any]],
        local_dirs: dict[str, str],
        size: int,
    ):
        super().__init__()
        self.spec = spec
        self.history = history
        self.local_dirs = local_dirs
        # The learning rate in the checkpoint is scaled for this many ranks (see _restore).
        self.size = size

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        spec = self.spec
        entry: dict[str, Any] = {"epoch": int(epoch)}
        entry.update({k: _plain(v) for k, v in (logs or {}).items()})
        self.history.append(entry)
        ckpt = checkpoint_path(spec.store, spec.run_id)
        with tempfile.TemporaryDirectory(prefix="se-keras-ckpt-", dir=scratch_root()) as tmp:
            local = os.path.join(tmp, CHECKPOINT_FILE)
            self.model.save(local)
            spec.store.upload_file(local, ckpt, atomic=True)
        info = checkpoint.CheckpointInfo(
            framework=FRAMEWORK,
            epoch=int(epoch),
            num_proc=self.size,
            history=tuple(self.history),
            fingerprint=checkpoint.keras_fingerprint(self.model),
        )
        checkpoint.write_info(spec.store, spec.run_id, info)
        from spark_estimators.store.base import CHECKPOINTS_SUBDIR, LOGS_SUBDIR

        for subdir, local_dir in self.local_dirs.items():
            target = CHECKPOINTS_SUBDIR if subdir == "checkpoints" else LOGS_SUBDIR
            spec.store.sync_dir(local_dir, spec.run_id, subdir=target)
        send_event("epoch", entry)


def _plain(value: Any) -> Any:
    """Log values as JSON-friendly Python scalars."""
    if isinstance(value, np.ndarray | np.generic):
        return value.item() if np.ndim(value) == 0 else value.tolist()
    if hasattr(value, "numpy"):
        return _plain(value.numpy())
    return value


def send_event(kind: str, data: Any) -> None:
    from spark_estimators.task import send_event as _send

    _send(kind, data)


def _rank_zero_callbacks(
    user: KerasUserObjects, rank: int, local_dirs: dict[str, str]
) -> list[Any]:
    """The user's callbacks; file-writing ones run on rank 0 only, into local dirs we sync."""
    out: list[Any] = []
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


def _load_checkpoint_callback_weights(model: Any, user: KerasUserObjects) -> None:
    """Rank 0: give back the weights ``checkpoint_callback`` saved last (e.g. the best epoch)."""
    cb = user.checkpoint_callback
    path = str(getattr(cb, "filepath", "") or "")
    if cb is None or not os.path.isfile(path):
        return  # never saved, or a per-epoch file name pattern: keep the final weights
    if path.endswith(".weights.h5") or path.endswith(".keras"):
        model.load_weights(path)


def _redirect(cb: Any, local_dirs: dict[str, str]) -> None:
    """Point a ModelCheckpoint at a local dir synced to the run's ``checkpoints/``."""
    local = local_dirs.setdefault("checkpoints", make_temp_dir("se-ckpt-"))
    name = os.path.basename(str(cb.filepath)) or "model.keras"
    if name in (CHECKPOINT_FILE, checkpoint.INFO_FILE):
        name = "user_" + name  # the store checkpoint of the run has that name
    cb.filepath = os.path.join(local, name)


def _compile(model: Any, user: KerasUserObjects, spec: KerasTrainSpec, size: int) -> None:
    import spark_estimators.collective.keras as hvd

    optimizer = optimizer_from_recipe(user.optimizer_recipe)
    if spec.scale_lr and size > 1:
        scale_learning_rate(optimizer, float(size))
    compression = hvd.Compression.fp16 if spec.compression == "fp16" else hvd.Compression.none
    model.compile(
        optimizer=hvd.DistributedOptimizer(optimizer, compression=compression),
        loss=user.loss,
        loss_weights=spec.loss_weights,
        metrics=user.metrics,
        jit_compile=False,
    )


def _restore(model: Any, spec: KerasTrainSpec, size: int) -> None:
    """Load the run's last checkpoint (weights and optimizer state) into ``model``.

    The optimizer state includes the learning rate, scaled for the ranks of the run that saved
    it; with ``scale_lr`` and another number of ranks now (an elastic relaunch with fewer, or a
    hot start with another ``num_proc``) it is re-scaled to ``size``, keeping whatever a
    callback such as ReduceLROnPlateau did to it.
    """
    ckpt = checkpoint_path(spec.store, spec.run_id)
    info = checkpoint.read_info(spec.store, spec.run_id)
    saved_size = size if info is None or info.num_proc is None else info.num_proc
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
    if spec.scale_lr and saved_size != size:
        scale_learning_rate(model.optimizer, size / saved_size)


def train(spec: KerasTrainSpec) -> dict[str, Any]:
    """Train on this rank; rank 0 returns the trained model as ``.keras`` bytes and history."""
    import cloudpickle

    import spark_estimators.collective.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _size_tensorflow(hvd.local_size(), spec.use_gpu)
    if spec.seed is not None:
        keras.utils.set_random_seed(spec.seed)
    custom_objects = cloudpickle.loads(spec.custom_objects_blob) or {}
    with keras.saving.custom_object_scope(custom_objects):
        user: KerasUserObjects = cloudpickle.loads(spec.user_blob)
        model = model_from_bytes(spec.model_bytes, custom_objects, compile=False)
        _compile(model, user, spec, size)
    if spec.start_epoch > 0 and rank == 0:
        _restore(model, spec, size)  # the other ranks get it from the broadcast below
    train_reader = spec.open_reader("train", rank, size, user.transformation_fn)
    steps, repeat = _steps(train_reader, spec.train_steps_per_epoch)
    feed = EpochFeed(train_reader, spec, spec.start_epoch, repeat)
    val_data, val_steps = None, None
    if spec.meta.has_val:
        val_reader = spec.open_reader("val", rank, size, user.transformation_fn)
        val_steps, val_repeat = _steps(val_reader, spec.validation_steps_per_epoch)
        val_data = make_dataset(EpochFeed(val_reader, spec, 0, val_repeat), spec)
    history = list(spec.history)
    local_dirs: dict[str, str] = {}
    try:
        callbacks: list[Any] = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            FeedEpochCallback(feed),
            *_rank_zero_callbacks(user, rank, local_dirs),
            hvd.callbacks.StopTrainingAgreement(),
        ]
        if rank == 0:
            callbacks += [FirstBatchEvent(), StoreCheckpoint(spec, history, local_dirs, size)]
        model.fit(
            make_dataset(feed, spec),
            epochs=spec.epochs,
            initial_epoch=spec.start_epoch,
            steps_per_epoch=steps,
            validation_data=val_data,
            validation_steps=val_steps,
            callbacks=callbacks,
            shuffle=False,  # the reader shuffles (seeded per epoch and rank)
            verbose=2 if spec.verbose >= 2 and rank == 0 else 0,
        )
        result: dict[str, Any] = {"rank": rank, "fingerprint": checkpoint.keras_fingerprint(model)}
        if rank == 0:
            _load_checkpoint_callback_weights(model, user)
    finally:
        for local_dir in local_dirs.values():
            shutil.rmtree(local_dir, ignore_errors=True)
    if rank == 0:
        result.update(
            model=model_to_bytes(model),
            history=history,
            output_shapes=_output_shapes(model, feed, spec),
        )
    hvd.shutdown()
    return result


def _output_shapes(model: Any, feed: EpochFeed, spec: KerasTrainSpec) -> list[tuple[int, ...]]:
    """Per-row shape of each model output, from one prediction on a training batch."""
    batch = feed.peek()
    inputs = [batch[c] for c in spec.feature_cols]
    outputs = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
    outs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    return [tensors.output_row_shape(np.asarray(o)) for o in outs]
