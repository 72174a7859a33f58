"""What every rank runs for ``KerasEstimator.fit`` (executor side; module-level, no closures).

Per rank: quiet TensorFlow and size its thread pools to this rank's share of the cores, init the
collective group, rebuild the user's model (``.keras`` bytes, ``custom_objects`` in scope, their
``"package>name"`` registrations made again) and optimizer, scale the learning rate by the
number of ranks (Horovod's rule; ``scale_lr=False`` keeps it), wrap the optimizer in
:func:`~spark_estimators.collective.keras.DistributedOptimizer`, compile with the user's loss,
metrics and loss weights (``jit_compile=False``), restore the last checkpoint on hot-start, and
run the real ``model.fit`` on the sharded reader as ``tf.data`` (every rank runs the same number
of steps). A loss or metric that cannot be saved is left out of every archive the rank writes,
so the model comes back uncompiled instead of the run failing.
Callback order, which is what makes the ranks agree:

1. ``BroadcastGlobalVariablesCallback(0)``: rank 0's model and optimizer state everywhere;
2. ``MetricAverageCallback``: each epoch's logs become the mean over the ranks;
   (with ``average_running_stats``: ``AverageRunningStats``, whose ``on_train_end`` averages
   BatchNormalization's moving statistics before the user's callbacks see them);
3. the user's callbacks (``ModelCheckpoint`` and ``TensorBoard`` only on rank 0, writing into
   the run's directory in the store), then ``checkpoint_callback`` on rank 0;
4. ``StopTrainingAgreement``: a rank stops after an epoch only together with the others;
5. rank 0: the store checkpoint (``checkpoint.keras`` + ``checkpoint.json``), TensorBoard sync
   and the epoch's metrics sent to the driver (:mod:`spark_estimators.keras.callbacks`).

The protocol shared with the other frameworks (readers, steps, events, ``checkpoint.json``, the
result dict) is :mod:`spark_estimators.core.rank`; batches are made by the shared
:class:`~spark_estimators.core.batches.BatchConverter` (scalar features and labels ``[n, 1]``,
numpy) in the reader's prefetch thread.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spark_estimators import envvars

if os.environ.get(envvars.SE_RANK) is not None:
    # A rank process: quiet TensorFlow's C++ logging before the first import of TensorFlow.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from spark_estimators.core import checkpoint  # noqa: E402
from spark_estimators.core import rank as protocol  # noqa: E402
from spark_estimators.core.batches import BatchConverter, epoch_batches  # noqa: E402
from spark_estimators.core.spec import TrainSpec  # noqa: E402
from spark_estimators.keras import callbacks as rank_callbacks  # noqa: E402
from spark_estimators.keras.callbacks import CHECKPOINT_FILE, checkpoint_path  # noqa: E402
from spark_estimators.keras.serialization import (  # noqa: E402
    OptimizerRecipe,
    drop_unsaveable_compile_state,
    model_from_bytes,
    model_to_bytes,
    optimizer_from_recipe,
    optimizer_recipe,
    register_shipped_objects,
    scale_learning_rate,
)

if TYPE_CHECKING:
    import tensorflow as tf

    from spark_estimators.core.rank import RankReader

__all__ = [
    "CHECKPOINT_FILE",
    "EpochFeed",
    "KerasTrainSpec",
    "KerasUserObjects",
    "checkpoint_path",
    "model_from_bytes",
    "model_to_bytes",
    "optimizer_recipe",
    "train",
]


@dataclass(kw_only=True)
class KerasTrainSpec(TrainSpec):
    """Everything a rank needs. User objects travel pickled; the model as ``.keras`` bytes."""

    model_bytes: bytes
    custom_objects_blob: bytes
    loss_weights: list[float] | dict[str, float] | None
    compression: str
    scale_lr: bool
    verbose: int


@dataclass
class KerasUserObjects:
    """Objects unpickled inside ``custom_object_scope`` (Keras objects may need it)."""

    optimizer_recipe: OptimizerRecipe
    loss: object  # as model.compile takes it: a name, a function, a Loss, a list or a dict
    metrics: object
    callbacks: list[keras.callbacks.Callback]
    checkpoint_callback: keras.callbacks.ModelCheckpoint | None = None
    transformation_fn: Callable[..., object] | None = None


# -- rank setup ----------------------------------------------------------------------------------
def _size_tensorflow(local_size: int, use_gpu: bool | None) -> None:
    import tensorflow as tf

    # Each rank gets its share of the host's cores: N ranks x all cores oversubscribes the CPU.
    threads = protocol.cpu_share(local_size)
    if threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    if use_gpu is False:
        tf.config.set_visible_devices([], "GPU")
        return
    # The host's GPUs are visible to every rank (docs/clusters.md, "GPUs"): TensorFlow would
    # reserve memory on each of them, so it is given the rank's own GPU only, as horovod's
    # set_visible_devices idiom does.
    from spark_estimators._base.gpus import own_cuda_indices

    gpus = tf.config.list_physical_devices("GPU")
    own = [i for i in own_cuda_indices() if i < len(gpus)]
    if gpus and own:
        tf.config.set_visible_devices(gpus[own[0]], "GPU")
        tf.config.experimental.set_memory_growth(gpus[own[0]], True)


# -- data ----------------------------------------------------------------------------------------
class EpochFeed:
    """A reader view for :func:`spark_estimators.data.tf_dataset`: model-ready arrays.

    Columns are what ``transform`` feeds the model (the shared
    :class:`~spark_estimators.core.batches.BatchConverter`: float32, scalars ``[n, 1]``, shapes
    from ``input_shapes``/``label_shapes``). The reader epoch of each pass is set by the fit
    loop (:class:`~spark_estimators.keras.callbacks.FeedEpochCallback`), so Keras's extra look
    at the first batch before training does not shift the shuffling; with ``repeat`` (fixed
    steps per epoch) each pass takes the next reader epoch instead.
    """

    def __init__(self, reader: RankReader, spec: KerasTrainSpec, start_epoch: int, repeat: bool):
        self.reader = reader
        self.convert = BatchConverter.for_spec(spec, scalar_labels_as_column=True, to_torch=False)
        self.batch_size = reader.batch_size
        self.steps_per_epoch = reader.steps_per_epoch
        self.epoch = start_epoch
        self.repeat = repeat

    def peek(self) -> dict[str, np.ndarray]:
        """The first batch of the shard, converted."""
        return self.convert(self.reader.peek())

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        epoch = self.epoch
        if self.repeat:
            self.epoch += 1
        return epoch_batches(self.reader, self.convert, epoch=epoch)


def make_dataset(feed: EpochFeed, spec: KerasTrainSpec) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` over the feed's batches, repeated when the epoch needs more steps."""
    from spark_estimators.data import tf_dataset

    ds = tf_dataset(feed, spec.feature_cols, spec.label_cols, spec.sample_weight_col)
    return ds.repeat() if feed.repeat else ds


def _steps(reader: RankReader, limit: int | None) -> tuple[int | None, bool]:
    """Keras ``steps_per_epoch`` and whether the dataset must repeat to provide them."""
    if reader.steps_per_epoch is None:
        # data="stream": the count is agreed while the data is read; the reader ends each epoch
        # (limit applied) and Keras runs each pass until its dataset ends.
        reader.plan(limit, 1)
        return None, False
    if limit is None or int(limit) >= int(reader.steps_per_epoch):
        return None, False
    return int(limit), True


def _compile(model: keras.Model, user: KerasUserObjects, spec: KerasTrainSpec, size: int) -> None:
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


def train(spec: KerasTrainSpec) -> dict[str, object]:
    """Train on this rank; rank 0 returns the trained model as ``.keras`` bytes and history."""
    import cloudpickle

    import spark_estimators.collective.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _size_tensorflow(hvd.local_size(), spec.use_gpu)
    if spec.seed is not None:
        keras.utils.set_random_seed(spec.seed)
    custom_objects = cloudpickle.loads(spec.custom_objects_blob) or {}
    register_shipped_objects(custom_objects)
    with keras.saving.custom_object_scope(custom_objects):
        user: KerasUserObjects = cloudpickle.loads(spec.user_blob)
        model = model_from_bytes(spec.model_bytes, custom_objects, compile=False)
        _compile(model, user, spec, size)
    # A loss/metric that cannot be saved must not fail the checkpoints and the result.
    compile_state_error = drop_unsaveable_compile_state(model)
    if spec.start_epoch > 0 and rank == 0:
        # The other ranks get it from the broadcast of BroadcastGlobalVariablesCallback.
        rank_callbacks.restore_checkpoint(model, spec, size)
    train_reader, val_reader = protocol.open_readers(spec, rank, size, user.transformation_fn)
    steps, repeat = _steps(train_reader, spec.train_steps_per_epoch)
    feed = EpochFeed(train_reader, spec, spec.start_epoch, repeat)
    val_data, val_steps = None, None
    if val_reader is not None:
        val_steps, val_repeat = _steps(val_reader, spec.validation_steps_per_epoch)
        val_data = make_dataset(EpochFeed(val_reader, spec, 0, val_repeat), spec)
    history = list(spec.history)
    local_dirs: dict[str, str] = {}
    try:
        callbacks: list[keras.callbacks.Callback] = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            rank_callbacks.FeedEpochCallback(feed),
            *([rank_callbacks.AverageRunningStats()] if spec.average_running_stats else []),
            *rank_callbacks.rank_zero_callbacks(user, rank, local_dirs),
            hvd.callbacks.StopTrainingAgreement(),
        ]
        if rank == 0:
            callbacks += [
                rank_callbacks.FirstBatchEvent(),
                rank_callbacks.StoreCheckpoint(spec, history, local_dirs, size),
            ]
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
        fingerprint = checkpoint.keras_fingerprint(model)
        if rank == 0:
            rank_callbacks.load_checkpoint_callback_weights(model, user)
    finally:
        for local_dir in local_dirs.values():
            shutil.rmtree(local_dir, ignore_errors=True)
    shapes, payload = None, {}
    if rank == 0:
        shapes = _output_shapes(model, feed, spec)
        payload = {"model": model_to_bytes(model), "compile_state_error": compile_state_error}
    hvd.shutdown()
    return protocol.rank_result(rank, fingerprint, history, shapes, **payload)


def _output_shapes(
    model: keras.Model, feed: EpochFeed, spec: KerasTrainSpec
) -> list[tuple[int, ...]]:
    """Per-row shape of each model output, from one prediction on a training batch."""
    batch = feed.peek()
    inputs = [batch[c] for c in spec.feature_cols]
    outputs = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
    # A dict of named outputs is one output per name, in Keras's order (model.output_names).
    return protocol.row_shapes(keras.tree.flatten(outputs))
