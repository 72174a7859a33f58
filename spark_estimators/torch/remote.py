"""What every rank runs for ``TorchEstimator.fit`` (executor side; module-level, no closures).

Per rank: init the collective group, pick the device (the task's GPU, as ``cuda:0``, when there
is one and ``use_gpu`` allows), restore the last checkpoint on hot-start, broadcast parameters
and optimizer state from rank 0, scale the learning rate by the number of ranks (Horovod's rule:
users give the single-process rate; ``scale_lr=False`` turns it off), train with
``DistributedOptimizer`` on the sharded reader (every rank runs the same number of steps), average
loss and metrics over the ranks each epoch, validate, call the callbacks, and on rank 0 write an
atomic checkpoint, TensorBoard scalars and send the epoch's metrics to the driver.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import io
import logging
import shutil
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_estimators.core import checkpoint, tensors
from spark_estimators.core.spec import TrainSpec
from spark_estimators.task.scratch import make_temp_dir
from spark_estimators.torch import serialization

logger = logging.getLogger(__name__)

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

    model: Any
    optimizer: Any
    losses: list[Any]
    metrics: list[Any]
    callbacks: list[Any]
    transformation_fn: Any = None
    train_minibatch_fn: Any = None


def checkpoint_paths(store: Any, run_id: str) -> tuple[str, str]:
    """The run's ``checkpoint.pt`` and ``checkpoint.json`` paths in ``store``."""
    base = store.get_checkpoint_path(run_id)
    return base.rstrip("/") + "/" + CHECKPOINT_FILE, checkpoint.info_path(store, run_id)


def metric_name(metric: Any) -> str:
    return str(getattr(metric, "__name__", None) or type(metric).__name__)


def metric_plan(metrics: list[Any], label_cols: list[str]) -> list[tuple[str, Any, int]]:
    """``(name, fn, output index)`` for each metric value recorded per epoch.

    As in Horovod, an entry may be a group (a list): one function for every output, or one per
    output. A plain function is one group of one. With one label a metric is named by its
    function (``mae``); with several, by function and label column (``mae_y1``, ``mae_y2``).
    """
    several = len(label_cols) > 1
    plan = []
    for entry in metrics:
        group = list(entry) if isinstance(entry, list | tuple) else [entry]
        fns = group * len(label_cols) if len(group) == 1 else group
        for i, (fn, col) in enumerate(zip(fns, label_cols, strict=True)):
            plan.append((f"{metric_name(fn)}_{col}" if several else metric_name(fn), fn, i))
    return plan


def _call(callbacks: list[Any], hook: str, *args: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


class _Batches:
    """Turns reader batches (dicts of numpy arrays) into device tensors for the model."""

    def __init__(self, spec: TorchTrainSpec, device: Any, transformation_fn: Any):
        self.spec, self.device = spec, device
        self.transformation_fn = transformation_fn

    def to_tensors(self, batch: dict[str, np.ndarray]) -> tuple[list[Any], list[Any], Any]:
        import torch

        spec = self.spec
        inputs = tensors.model_inputs(batch, spec.feature_cols, spec.input_shapes)
        labels = tensors.model_inputs(
            batch, spec.label_cols, spec.label_shapes, scalar_as_column=False
        )
        weights = None
        if spec.sample_weight_col:
            weights = torch.from_numpy(
                tensors.for_torch(np.asarray(batch[spec.sample_weight_col], dtype=np.float32))
            ).to(self.device)
        return (
            [torch.from_numpy(tensors.for_torch(a)).to(self.device) for a in inputs],
            [torch.from_numpy(tensors.for_torch(a)).to(self.device) for a in labels],
            weights,
        )


def compute_loss(
    losses: list[Any],
    outputs: list[Any],
    labels: list[Any],
    loss_weights: list[float] | None,
    sample_weights: Any,
) -> Any:
    """Horovod's loss: ``sum_i loss_weights[i] * loss_i``, equal weights ``1/labels`` by default.

    With ``sample_weights`` each loss must give one value per row (``losses`` are made so by
    :func:`unreduced`); as in Horovod the weighted loss is ``mean(loss_row * weight_row)``,
    not a weighted average, so two rows of equal weight count the same in any batch. A loss
    with several values per row (an ``[n, k]`` output) is averaged over them first.
    """
    if loss_weights is None:
        loss_weights = [1.0 / len(outputs)] * len(outputs)
    total = None
    for loss_fn, out, lab, weight in zip(losses, outputs, labels, loss_weights, strict=True):
        value = loss_fn(out, match_output(lab, out))
        if sample_weights is not None:
            if value.dim() == 0:
                raise ValueError(
                    f"sample_weight_col needs a loss that returns one value per row; "
                    f"{metric_name(loss_fn)} returned a scalar. Use a torch loss module "
                    "(e.g. torch.nn.MSELoss()), a functional loss with a `reduction` argument "
                    "(e.g. torch.nn.functional.mse_loss) or one that returns per-row values"
                )
            per_row = value.reshape(value.shape[0], -1).mean(dim=1)
            value = (per_row * sample_weights.reshape(-1)).mean()
        elif value.dim() != 0:
            value = value.mean()
        total = value * float(weight) if total is None else total + value * float(weight)
    return total


def unreduced(loss_fn: Any) -> Any:
    """``loss_fn`` returning per-element losses, as Horovod calls it for sample weights.

    A torch loss module (anything with a string ``reduction`` attribute) is copied with
    ``reduction='none'``; a function that takes a ``reduction`` keyword (``F.mse_loss``,
    ``F.cross_entropy``, ...) is called with ``reduction='none'``; anything else is used as it
    is and must return per-row values itself.
    """
    import torch

    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, torch.nn.Module) and isinstance(reduction, str):
        if reduction == "none":
            return loss_fn
        clone = copy.copy(loss_fn)
        clone.reduction = "none"  # type: ignore[assignment]
        return clone
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return loss_fn
    if "reduction" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        partial = functools.partial(loss_fn, reduction="none")
        functools.update_wrapper(partial, loss_fn)
        return partial
    return loss_fn


def transform_outputs(outputs: Any, labels: list[Any]) -> tuple[list[Any], list[Any]]:
    """Horovod's ``transform_outputs``: outputs as a list, each label shaped like its output."""
    outputs = _as_list(outputs)
    return outputs, [match_output(lab, out) for lab, out in zip(labels, outputs)]


class LossFn:
    """Horovod's ``loss_fn(outputs, labels, sample_weights)`` handed to ``train_minibatch_fn``."""

    def __init__(self, losses: list[Any], loss_weights: list[float] | None, weighted: bool):
        self.losses = [unreduced(f) for f in losses] if weighted else list(losses)
        self.loss_weights = loss_weights

    def __call__(self, outputs: Any, labels: list[Any], sample_weights: Any = None) -> Any:
        return compute_loss(
            self.losses, _as_list(outputs), labels, self.loss_weights, sample_weights
        )


def match_output(label: Any, output: Any) -> Any:
    """Reshape a label to its output's shape when both hold as many values (Horovod's rule)."""
    if label.shape != output.shape and label.numel() == output.numel():
        return label.reshape(output.shape)
    return label


def _as_list(outputs: Any) -> list[Any]:
    return list(outputs) if isinstance(outputs, list | tuple) else [outputs]


def send_event(kind: str, data: Any) -> None:
    from spark_estimators.task import send_event as _send

    _send(kind, data)


def _run_epoch(
    model: Any,
    reader: Any,
    epoch: int,
    steps: int,
    batches: _Batches,
    user: UserObjects,
    spec: TorchTrainSpec,
    optimizer: Any,
    loss_fn: LossFn,
    train: bool,
) -> tuple[float, float, list[float]]:
    """One pass; returns (sum of loss * rows, rows, sums of metric * rows) on this rank."""
    import torch

    loss_sum, rows = 0.0, 0.0
    plan = metric_plan(user.metrics, spec.label_cols)
    metric_sums = [0.0] * len(plan)
    k = spec.backward_passes_per_step
    model.train(train)
    reader.set_epoch(epoch)
    iterator = iter(reader)
    for step in range(steps):
        batch = next(iterator)
        inputs, labels, weights = batches.to_tensors(batch)
        n = float(inputs[0].shape[0])
        with torch.set_grad_enabled(train):
            if train and user.train_minibatch_fn is not None:
                # Horovod's contract: the fn zeroes, steps and returns (outputs, loss) itself.
                out, loss = user.train_minibatch_fn(
                    model, optimizer, transform_outputs, loss_fn, inputs, labels, weights
                )
                outputs = _as_list(out)
            else:
                outputs, matched = transform_outputs(model(*inputs), labels)
                loss = loss_fn(outputs, matched, weights)
                if train:
                    loss.backward()
                    if (step + 1) % k == 0:
                        optimizer.step()
                        optimizer.zero_grad()
        loss_sum += float(loss.detach()) * n
        rows += n
        if train and step == 0 and epoch == spec.start_epoch and hvd_rank() == 0:
            send_event("first_batch", time.time())  # time to first batch, for the driver
        with torch.no_grad():
            for i, (_, metric, index) in enumerate(plan):
                out = outputs[index].detach()
                metric_sums[i] += float(metric(out, match_output(labels[index], out))) * n
    close = getattr(iterator, "close", None)
    if close is not None:
        close()  # stops the reader's prefetch thread when fewer steps than an epoch were taken
    return loss_sum, rows, metric_sums


def hvd_rank() -> int:
    from spark_estimators.collective import rank

    return int(rank())


def hvd_size() -> int:
    from spark_estimators.collective import size

    return int(size())


def _average(hvd: Any, loss_sum: float, rows: float, metric_sums: list[float]) -> list[float]:
    import torch

    t = torch.tensor([loss_sum, rows, *metric_sums], dtype=torch.float64)
    t = hvd.allreduce(t, op=hvd.Sum, name="epoch_metrics")
    total_rows = max(float(t[1]), 1.0)
    return [float(v) / total_rows for v in [t[0], *t[2:]]]


def _save_checkpoint(
    spec: TorchTrainSpec, model: Any, optimizer: Any, epoch: int, history: list[dict[str, Any]]
) -> None:
    import torch

    ckpt, _ = checkpoint_paths(spec.store, spec.run_id)
    buf = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "size": hvd_size(),
            "history": history,
        },
        buf,
    )
    spec.store.write_bytes_atomic(ckpt, buf.getvalue())
    # Written second: an info file always names a complete checkpoint.
    info = checkpoint.CheckpointInfo(
        framework=FRAMEWORK,
        epoch=epoch,
        num_proc=hvd_size(),
        history=tuple(history),
        fingerprint=checkpoint.torch_fingerprint(model),
    )
    checkpoint.write_info(spec.store, spec.run_id, info)


class _TensorBoard:
    """Scalars into a local event dir, synced to the run's logs/ in the store (rank 0)."""

    def __init__(self, spec: TorchTrainSpec):
        self.spec = spec
        # Synced to the store after every epoch; removed by close() (or with the rank's scratch).
        self.local = make_temp_dir("se-tb-")
        self.writer: Any = None
        try:
            # tensorboard imports TensorFlow for file I/O when it is installed (seconds of start-up
            # in every torch rank); its marker module makes it use its own light stub instead.
            if "tensorflow" not in sys.modules:
                sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.local)
        except ImportError:
            logger.warning("tensorboard is not installed: no TensorBoard logs for this run")

    def log(self, epoch: int, logs: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in logs.items():
            if key != "epoch" and isinstance(value, float):
                self.writer.add_scalar(key, value, epoch)
        self.writer.flush()
        self.spec.store.sync_dir(self.local, self.spec.run_id)

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


def _preload_in_background(modules: tuple[str, ...]) -> None:
    """Import ``modules`` on a thread while this rank meets the others and opens its data.

    The reader's first scan imports ``pyarrow.dataset`` (about 0.5 s) and the first
    ``optimizer.step()`` imports ``torch._dynamo`` (about 2 s of CPU): started here they overlap
    the rendezvous and the parameter broadcast, which mostly wait on sockets. An import error is
    left for the main thread to meet.
    """

    def load() -> None:
        for name in modules:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the main thread imports it again and reports
                    return

    threading.Thread(target=load, name="se-preload", daemon=True).start()


def train(spec: TorchTrainSpec) -> dict[str, Any]:
    """Train on this rank; rank 0 returns the state dict, every rank a weights fingerprint."""
    import cloudpickle
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.torch import Compression
    from spark_estimators.task import get_device

    _preload_in_background(("pyarrow.dataset", "torch._dynamo"))
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device_name = get_device()
    use_cuda = spec.use_gpu is not False and device_name.startswith("cuda")
    device = torch.device(device_name if use_cuda else "cpu")
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    user: UserObjects = cloudpickle.loads(spec.user_blob)
    model, optimizer = serialization.unpack(user.model, user.optimizer)
    model = model.to(device)
    loss_fn = LossFn(user.losses, spec.loss_weights, weighted=bool(spec.sample_weight_col))
    if spec.scale_lr:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * size
    history = list(spec.history)
    start_epoch = spec.start_epoch
    if spec.start_epoch > 0 and rank == 0:
        ckpt, _ = checkpoint_paths(spec.store, spec.run_id)
        state = serialization.load_checkpoint(
            io.BytesIO(spec.store.read_bytes(ckpt)), map_location=device, name=ckpt
        )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if int(state.get("epoch", -1)) >= start_epoch and "history" in state:
            # Rank 0 died between writing checkpoint.pt and checkpoint.json: the weights are
            # a newer epoch's than the info file says; go on after that epoch, not repeat it.
            start_epoch = int(state["epoch"]) + 1
            history = list(state["history"])
        saved_size = int(state.get("size", size))
        if spec.scale_lr and saved_size != size:
            # The saved rates were scaled for the ranks of that run (an elastic relaunch can
            # have fewer): rescale, keeping whatever a callback or schedule did to them.
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * size / saved_size
    if spec.start_epoch > 0:
        start_epoch = int(hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = Compression.fp16 if spec.compression == "fp16" else Compression.none
    dist_opt = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    batches = _Batches(spec, device, user.transformation_fn)
    train_reader = spec.open_reader("train", rank, size, user.transformation_fn)
    val_reader = (
        spec.open_reader("val", rank, size, user.transformation_fn) if spec.meta.has_val else None
    )
    train_steps = checkpoint.epoch_steps(
        train_reader, spec.train_steps_per_epoch, spec.backward_passes_per_step
    )
    val_steps = (
        checkpoint.epoch_steps(val_reader, spec.validation_steps_per_epoch) if val_reader else 0
    )
    board = _TensorBoard(spec) if rank == 0 else None
    names = [name for name, _, _ in metric_plan(user.metrics, spec.label_cols)]
    _call(user.callbacks, "on_train_begin", {})
    try:
        for epoch in range(start_epoch, spec.epochs):
            _call(user.callbacks, "on_epoch_begin", epoch, {})
            sums = _run_epoch(
                model,
                train_reader,
                epoch,
                train_steps,
                batches,
                user,
                spec,
                dist_opt,
                loss_fn,
                True,
            )
            avg = _average(hvd, *sums)
            logs: dict[str, Any] = {"epoch": epoch, "loss": avg[0]}
            logs.update({n: v for n, v in zip(names, avg[1:], strict=True)})
            if val_reader is not None and val_steps:
                vsums = _run_epoch(
                    model,
                    val_reader,
                    epoch,
                    val_steps,
                    batches,
                    user,
                    spec,
                    dist_opt,
                    loss_fn,
                    False,
                )
                vavg = _average(hvd, *vsums)
                logs["val_loss"] = vavg[0]
                logs.update({"val_" + n: v for n, v in zip(names, vavg[1:], strict=True)})
            history.append(logs)
            _call(user.callbacks, "on_epoch_end", epoch, logs)
            if rank == 0:
                _save_checkpoint(spec, model, optimizer, epoch, history)
                assert board is not None
                board.log(epoch, logs)
                send_event("epoch", logs)
            stop = any(bool(getattr(cb, "stop_training", False)) for cb in user.callbacks)
            # Every rank must agree, or the next collective would hang on the ones that go on.
            flag = hvd.allreduce(torch.tensor([float(stop)]), op=hvd.Max, name="stop_training")
            if float(flag[0]) > 0:
                break
        _call(user.callbacks, "on_train_end", {"history": history})
    finally:
        if board is not None:
            board.close()
    output_shapes = _output_shapes(model, train_reader, batches)
    result: dict[str, Any] = {"rank": rank, "fingerprint": checkpoint.torch_fingerprint(model)}
    if rank == 0:
        model.cpu()
        result.update(
            state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
            history=history,
            output_shapes=output_shapes,
        )
    hvd.shutdown()
    return result


def _output_shapes(model: Any, reader: Any, batches: _Batches) -> list[tuple[int, ...]]:
    """Per-row shape of each model output, from one forward pass on a training batch."""
    import torch

    model.eval()
    inputs, _, _ = batches.to_tensors(reader.peek())
    with torch.no_grad():
        outputs = _as_list(model(*inputs))
    return [tensors.output_row_shape(o.detach().cpu().numpy()) for o in outputs]
