"""What every rank runs for ``TorchEstimator.fit`` (executor side; module-level, no closures).

Per rank: init the collective group, pick the device (the task's own GPU, ``get_device()``, when
there is one and ``use_gpu`` allows), restore the last checkpoint on hot-start, broadcast parameters
and optimizer state from rank 0, scale the learning rate by the number of ranks (Horovod's rule:
users give the single-process rate; ``scale_lr=False`` turns it off), train with
``DistributedOptimizer`` on the sharded reader, call the callbacks, and on rank 0 write an atomic
``checkpoint.pt`` and TensorBoard scalars. BatchNorm running statistics stay per rank (rank 0's
are returned) unless ``average_running_stats`` averages them before ``on_train_end``. The
protocol shared with the other frameworks (steps per epoch, metric averaging over the ranks,
events to the driver, ``checkpoint.json``, the result dict) is
:mod:`spark_estimators.core.rank`; batches come from :mod:`spark_estimators.core.batches`,
converted to tensors in the reader's prefetch thread.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spark_estimators.core import checkpoint
from spark_estimators.core import rank as protocol
from spark_estimators.core.batches import BatchConverter, epoch_batches
from spark_estimators.core.spec import TrainSpec
from spark_estimators.errors import ConfigurationError
from spark_estimators.torch import losses, serialization
from spark_estimators.torch.callbacks import scale_learning_rates
from spark_estimators.torch.running_stats import average_running_stats

if TYPE_CHECKING:
    import torch

    from spark_estimators.core.rank import RankReader
    from spark_estimators.store.base import StoreBase
    from spark_estimators.torch.losses import Loss, MetricEntry, Outputs
    from spark_estimators.torch.serialization import TravellingModel, TravellingOptimizer

CHECKPOINT_FILE = "checkpoint.pt"
FRAMEWORK = "torch"


@dataclass(kw_only=True)
class TorchTrainSpec(TrainSpec):
    """Everything a rank needs; user objects travel pickled in ``user_blob``."""

    loss_weights: list[float] | None
    backward_passes_per_step: int
    compression: str
    scale_lr: bool


@dataclass
class UserObjects:
    """The user's objects, pickled together so the optimizer keeps pointing at the model."""

    model: TravellingModel
    optimizer: TravellingOptimizer
    losses: list[Loss]
    metrics: list[MetricEntry]
    callbacks: list[object]
    transformation_fn: Callable[..., object] | None = None
    train_minibatch_fn: Callable[..., tuple[Outputs, torch.Tensor]] | None = None


def checkpoint_paths(store: StoreBase, run_id: str) -> tuple[str, str]:
    """The run's ``checkpoint.pt`` and ``checkpoint.json`` paths in ``store``."""
    weights = checkpoint.store_path(store, run_id, CHECKPOINT_FILE)
    return weights, checkpoint.info_path(store, run_id)


def _call(callbacks: Sequence[object], hook: str, *args: object) -> None:
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


def converter(spec: TorchTrainSpec) -> BatchConverter:
    """Torch batches: scalar features ``[n, 1]``, scalar labels ``[n]`` (as ``transform``)."""
    return BatchConverter.for_spec(spec, scalar_features_as_column=True)


def _on_device(
    spec: TorchTrainSpec, batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """``(inputs, labels, sample weights)`` of a converted batch, moved to ``device``.

    ``non_blocking``: on a GPU rank the reader stages batches in pinned memory
    (``data/_staging.py``), so the copy is a DMA the training thread does not wait for and it can
    queue this step's kernels while the GPU still runs the last one (a no-op on the CPU).
    """
    if device.type == "cpu":  # the reader's tensors are there already (no op a tensor a step)
        weights = batch[spec.sample_weight_col] if spec.sample_weight_col else None
        return [batch[c] for c in spec.feature_cols], [batch[c] for c in spec.label_cols], weights
    inputs = [batch[c].to(device, non_blocking=True) for c in spec.feature_cols]
    labels = [batch[c].to(device, non_blocking=True) for c in spec.label_cols]
    weights = (
        batch[spec.sample_weight_col].to(device, non_blocking=True)
        if spec.sample_weight_col
        else None
    )
    return inputs, labels, weights


@dataclass
class _Epoch:
    """What one pass over a reader needs besides the reader."""

    spec: TorchTrainSpec
    user: UserObjects
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: losses.LossFn
    device: torch.device
    convert: BatchConverter
    first_batch: protocol.FirstBatchEvent

    def run(self, reader: RankReader, epoch: int, steps: int | None, train: bool) -> list[float]:
        """One pass; returns ``[loss, *metrics]`` averaged over the rows of all ranks."""
        import torch

        model, user, k = self.model, self.user, self.spec.backward_passes_per_step
        plan = losses.metric_plan(user.metrics, self.spec.label_cols)
        sums = protocol.EpochSums(len(plan))
        # The loss sum stays on the device until the epoch ends: a float() per step would wait
        # for the GPU at every step and keep the next batch's host work from overlapping it.
        loss_sum: torch.Tensor | None = None
        on_cpu = self.device.type == "cpu"
        model.train(train)
        for step, batch in enumerate(epoch_batches(reader, self.convert, steps, epoch)):
            inputs, labels, weights = _on_device(self.spec, batch, self.device)
            with torch.set_grad_enabled(train):
                if train and user.train_minibatch_fn is not None:
                    # Horovod's contract: the fn zeroes, steps and returns (outputs, loss) itself.
                    args = (losses.transform_outputs, self.loss_fn, inputs, labels, weights)
                    out, loss = user.train_minibatch_fn(model, self.optimizer, *args)
                    outputs = losses.as_list(out)
                    _call(user.callbacks, "on_train_batch_end", step, {})
                else:
                    outputs, matched = losses.transform_outputs(model(*inputs), labels)
                    loss = self.loss_fn(outputs, matched, weights)
                    if train:
                        # horovod's estimator divides by k: the k passes' gradients are a mean.
                        (loss / k if k > 1 else loss).backward()
                        if (step + 1) % k == 0:
                            self.optimizer.step()
                            self.optimizer.zero_grad()
                            _call(user.callbacks, "on_train_batch_end", step, {})
            if train:
                self.first_batch()
            with torch.no_grad():
                values = []
                for _, metric, index in plan:
                    out = outputs[index].detach()
                    values.append(float(metric(out, losses.match_output(labels[index], out))))
            rows = float(inputs[0].shape[0])
            if on_cpu:  # nothing to wait for: one op a step instead of three (the same sum)
                sums.add(float(loss.detach()), rows, values)
                continue
            weighted = loss.detach().to(torch.float64) * rows
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            sums.add(0.0, rows, values)
        if loss_sum is not None:
            sums.loss = float(loss_sum)
        return protocol.average_over_ranks(sums)


def _callback_state(cb: object) -> object:
    state_dict = getattr(cb, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _save_checkpoint(
    spec: TorchTrainSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    callbacks: Sequence[object],
    epoch: int,
    history: list[dict[str, float]],
    size: int,
) -> None:
    import torch

    ckpt, _ = checkpoint_paths(spec.store, spec.run_id)
    buf = io.BytesIO()
    state: dict[str, object] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    # Callbacks with state (a LearningRateScheduler's schedule) go on where they stopped.
    state["callbacks"] = [_callback_state(cb) for cb in callbacks]
    torch.save({**state, "epoch": epoch, "size": size, "history": history}, buf)
    spec.store.write_bytes_atomic(ckpt, buf.getvalue())
    # Written second: an info file always names a complete checkpoint.
    fingerprint = checkpoint.torch_fingerprint(model)
    protocol.commit_epoch(spec.store, spec.run_id, FRAMEWORK, epoch, size, history, fingerprint)


def _restore(
    spec: TorchTrainSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    callbacks: Sequence[object],
    device: torch.device,
    size: int,
) -> tuple[int, list[dict[str, float]]]:
    """Rank 0 on hot-start: load ``checkpoint.pt``; returns (start epoch, history)."""
    ckpt, _ = checkpoint_paths(spec.store, spec.run_id)
    state = serialization.load_checkpoint(
        io.BytesIO(spec.store.read_bytes(ckpt)), map_location=device, name=ckpt
    )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    saved = state.get("callbacks") or []
    if len(saved) == len(callbacks):
        for cb, cb_state in zip(callbacks, saved, strict=True):
            if cb_state is not None and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(cb_state)
    start_epoch, history = spec.start_epoch, list(spec.history)
    if int(state.get("epoch", -1)) >= start_epoch and "history" in state:
        # Rank 0 died between writing checkpoint.pt and checkpoint.json: the weights are a newer
        # epoch's than the info file says; go on after that epoch, not repeat it.
        start_epoch, history = int(state["epoch"]) + 1, list(state["history"])
    factor = protocol.lr_rescale(spec.scale_lr, int(state.get("size", size)), size)
    scale_learning_rates(optimizer, callbacks, factor)
    return start_epoch, history


def train(spec: TorchTrainSpec) -> dict[str, object]:
    """Train on this rank; rank 0 returns the state dict, every rank a weights fingerprint."""
    import cloudpickle
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.torch import Compression
    from spark_estimators.task import context, get_device
    from spark_estimators.torch.logs import TensorBoardScalars

    context.mark("train_imports")
    protocol.preload_in_background(("pyarrow.dataset", "torch._dynamo"))
    hvd.init()
    context.mark("group_joined")
    rank, size = hvd.rank(), hvd.size()
    protocol.size_torch_threads(hvd.local_size())
    device_name = get_device()
    use_cuda = spec.use_gpu is not False and device_name.startswith("cuda")
    device = torch.device(device_name if use_cuda else "cpu")
    if use_cuda:  # the host's GPUs are visible: make the rank's own the default one
        torch.cuda.set_device(device)
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    user: UserObjects = cloudpickle.loads(spec.user_blob)
    model, optimizer = serialization.unpack(user.model, user.optimizer)
    for cb in user.callbacks:
        if getattr(cb, "optimizer", optimizer) is not optimizer:
            raise ConfigurationError(
                f"callback {type(cb).__name__} steps another optimizer than the estimator's "
                "(with a TorchScript model the optimizer is rebuilt on the rank): schedule the "
                "learning rate with a LearningRateScheduler on the optimizer given as optimizer="
                " and a plain torch.nn.Module model"
            )
    model = model.to(device)
    context.mark("user_loaded")
    loss_fn = losses.LossFn(user.losses, spec.loss_weights, weighted=bool(spec.sample_weight_col))
    if spec.scale_lr:
        scale_learning_rates(optimizer, user.callbacks, float(size))
    history, start_epoch = list(spec.history), spec.start_epoch
    if spec.start_epoch > 0:
        if rank == 0:
            start_epoch, history = _restore(spec, model, optimizer, user.callbacks, device, size)
        start_epoch = int(hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist_opt = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=Compression.fp16 if spec.compression == "fp16" else Compression.none,
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    context.mark("broadcast")
    convert = converter(spec)
    train_reader, val_reader = protocol.open_readers(spec, rank, size, user.transformation_fn)
    context.mark("readers_open")
    passes = _Epoch(
        spec, user, model, dist_opt, loss_fn, device, convert, protocol.FirstBatchEvent(rank == 0)
    )
    board = TensorBoardScalars(spec.store, spec.run_id) if rank == 0 else None
    names = [name for name, _, _ in losses.metric_plan(user.metrics, spec.label_cols)]
    _call(user.callbacks, "on_train_begin", {})
    try:
        for epoch in range(start_epoch, spec.epochs):
            _call(user.callbacks, "on_epoch_begin", epoch, {})
            # Per epoch: a streaming reader knows its count only after its first epoch.
            train_steps = protocol.epoch_steps(
                train_reader, spec.train_steps_per_epoch, spec.backward_passes_per_step
            )
            means = passes.run(train_reader, epoch, train_steps, train=True)
            val_means = None
            val_steps = (
                protocol.epoch_steps(val_reader, spec.validation_steps_per_epoch)
                if val_reader is not None
                else 0
            )
            if val_reader is not None and val_steps != 0:
                val_means = passes.run(val_reader, epoch, val_steps, train=False)
            logs = protocol.epoch_logs(epoch, names, means, val_means)
            history.append(logs)
            _call(user.callbacks, "on_epoch_end", epoch, logs)
            if rank == 0:
                assert board is not None
                _save_checkpoint(spec, model, optimizer, user.callbacks, epoch, history, size)
                board.log(epoch, logs)
                protocol.send_event("epoch", logs)
            stop = any(bool(getattr(cb, "stop_training", False)) for cb in user.callbacks)
            if protocol.stop_together(stop):  # else the ranks that go on would hang
                break
        if spec.average_running_stats:
            average_running_stats(model, lambda flat: hvd.allreduce_(flat, op=hvd.Sum), size)
        _call(user.callbacks, "on_train_end", {"history": history})
    finally:
        if board is not None:
            board.close()
    output_shapes = _output_shapes(model, train_reader, spec, convert, device)
    fingerprint = checkpoint.torch_fingerprint(model)
    state = None
    if rank == 0:
        model.cpu()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hvd.shutdown()
    return protocol.rank_result(rank, fingerprint, history, output_shapes, state_dict=state)


def _output_shapes(
    model: torch.nn.Module,
    reader: RankReader,
    spec: TorchTrainSpec,
    convert: BatchConverter,
    device: torch.device,
) -> list[tuple[int, ...]]:
    """Per-row shape of each model output, from one forward pass on a training batch."""
    import torch

    model.eval()
    inputs, _, _ = _on_device(spec, convert(reader.peek()), device)
    with torch.no_grad():
        return protocol.row_shapes(model(*inputs))
