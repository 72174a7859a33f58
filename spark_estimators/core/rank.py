"""The rank-side protocol every estimator's ``remote.train`` follows (executor side).

What the torch, Lightning and Keras ranks share, whatever trains the model:

- **Readers**: :func:`open_readers` opens this rank's shard of the train (and val) split with
  :func:`reader_options` (one :class:`~spark_estimators.data.ReaderOptions` per split, built
  from the spec); :func:`epoch_steps` is the steps per epoch, the same on every rank (a
  rank that stopped early would hang the others in the next collective).
- **Metrics**: a rank sums ``loss * rows`` and ``metric * rows`` over an epoch
  (:class:`EpochSums`); :func:`average_over_ranks` sums them over all ranks in one allreduce and
  divides by the rows of all ranks, so every rank gets the same row-weighted means;
  :func:`epoch_logs` names them (``loss``, metrics, ``val_`` + each).
- **Agreement**: :func:`stop_together` - a rank stops only when the others do.
- **Events to the driver** (rank 0): ``first_batch`` (wall time of the end of the first training
  step, :class:`FirstBatchEvent`) and ``epoch`` (the epoch's logs), shown by
  :mod:`spark_estimators.core.progress`.
- **Checkpoints**: the framework writes its own file, then :func:`commit_epoch` writes
  ``checkpoint.json`` (:mod:`spark_estimators.core.checkpoint`'s one schema) with the weights'
  fingerprint; :func:`lr_rescale` is the factor for a learning rate saved for another number of
  ranks.
- **Result**: :func:`rank_result` - every rank returns its rank and weights fingerprint (the
  driver checks that they agree); rank 0 adds the history, per-row output shapes and the
  framework's payload (weights or model bytes).

Each framework's ``remote.py`` keeps what only it knows: building and stepping the model.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

import numpy as np

from spark_estimators import envvars
from spark_estimators.core import checkpoint

if TYPE_CHECKING:
    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.data.options import ReaderOptions, TransformFn
    from spark_estimators.data.reader import BatchReader
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.data.stream_reader import StreamBatchReader
    from spark_estimators.store.base import StoreBase

    RankReader: TypeAlias = BatchReader | StreamBatchReader

logger = logging.getLogger(__name__)


# -- the rank and its start-up --------------------------------------------------------------------
def rank_and_size() -> tuple[int, int]:
    """The rank and the number of ranks, from the launcher's environment (before any init)."""
    return envvars.env_int(envvars.SE_RANK, 0), envvars.env_int(envvars.SE_SIZE, 1)


def local_size() -> int:
    """The ranks on this host, from the launcher's environment (before any init)."""
    return max(1, envvars.env_int(envvars.SE_LOCAL_SIZE, 1))


def cpu_share(ranks_on_host: int) -> int | None:
    """Compute threads for one rank: this process's cores split among the host's ranks.

    ``None`` when the user chose (``OMP_NUM_THREADS`` in the rank's environment, e.g. through the
    estimator's ``env``). Frameworks size their pools to every core by default, so N ranks on a
    host would run N x cores threads: on the 2-core machine two torch ranks with 2 threads each
    took 3.3 ms per step of a small MLP against 0.7 ms with 1 thread each (bench/RESULTS.md,
    issue 26).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, int(cores or 1) // max(1, ranks_on_host))


def size_torch_threads(ranks_on_host: int) -> None:
    """Give torch this rank's share of the cores (see :func:`cpu_share`)."""
    import torch

    threads = cpu_share(ranks_on_host)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def preload_in_background(modules: Sequence[str]) -> None:
    """Import ``modules`` on a thread while this rank meets the others and opens its data.

    The reader's first scan imports ``pyarrow.dataset`` (about 0.5 s) and torch's first
    ``optimizer.step()`` imports ``torch._dynamo`` (about 2 s of CPU): started here they overlap
    the rendezvous and the parameter broadcast, which mostly wait on sockets. An import error is
    left for the main thread to meet.
    """
    names = tuple(modules)

    def load() -> None:
        for name in names:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the main thread imports it again and reports
                    return

    threading.Thread(target=load, name="se-preload", daemon=True).start()


def light_tensorboard() -> None:
    """Make ``tensorboard`` use its own file I/O stub instead of importing TensorFlow.

    With TensorFlow installed, tensorboard imports it for file I/O: seconds of start-up in every
    torch or Lightning rank. Its marker module ``tensorboard.compat.notf`` turns that off (not in
    a Keras rank, which has TensorFlow loaded anyway).
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


T = TypeVar("T")


def _as_tuple(values: Sequence[T] | None) -> tuple[T, ...] | None:
    return None if values is None else tuple(values)


# -- readers --------------------------------------------------------------------------------------
def reader_options(
    spec: TrainSpec, split: str, transformation_fn: TransformFn | None
) -> ReaderOptions:
    """The :class:`~spark_estimators.data.ReaderOptions` of ``split`` ("train" or "val").

    Only the train split shuffles (``shuffle_buffer_size=0`` turns it off) and uses
    ``batch_size``; the val split reads in order with ``val_batch_size``. Both read the
    feature, label and sample weight columns.
    """
    from spark_estimators.data import ReaderOptions

    train = split == "train"
    columns = [*spec.feature_cols, *spec.label_cols]
    if spec.sample_weight_col:
        columns.append(spec.sample_weight_col)
    return ReaderOptions(
        batch_size=spec.batch_size if train else spec.val_batch_size,
        columns=tuple(columns),
        shuffle=spec.shuffle and train and spec.shuffle_buffer_size != 0,
        shuffle_buffer_size=spec.shuffle_buffer_size or None,
        seed=spec.seed if spec.seed is not None else 0,
        inmemory_cache=spec.inmemory_cache_all,
        transformation_fn=transformation_fn,
        num_workers=spec.train_reader_num_workers if train else spec.val_reader_num_workers,
        reader=spec.reader,
        pool_type=spec.reader_pool_type,
        transform_edit_fields=_as_tuple(spec.transformation_edit_fields),
        transform_removed_fields=_as_tuple(spec.transformation_removed_fields),
    )


def open_readers(
    spec: TrainSpec, rank: int, size: int, transformation_fn: TransformFn | None
) -> tuple[RankReader, RankReader | None]:
    """The rank's train reader, and its val reader (None when the data has no val split)."""
    from spark_estimators.data import make_batch_reader

    if getattr(spec.meta, "streamed", False):  # data="stream": the task's spill, not Parquet
        from spark_estimators.data.stream_reader import open_stream_readers

        def options_of(split: str) -> ReaderOptions:
            return reader_options(spec, split, transformation_fn)

        return open_stream_readers(
            cast("StreamMetadata", spec.meta), options_of, rank, transformation_fn
        )

    def open_split(split: str) -> BatchReader:
        options = reader_options(spec, split, transformation_fn)
        return make_batch_reader(spec.store, spec.meta, options, split=split, rank=rank, size=size)

    return open_split("train"), open_split("val") if spec.meta.has_val else None


def epoch_steps(reader: RankReader, limit: int | None, multiple: int = 1) -> int | None:
    """Steps per epoch: the reader's (same on every rank), capped by ``limit``.

    With ``multiple`` > 1 (``backward_passes_per_step``) the count is rounded **up** to a
    multiple of it, so every optimizer step accumulates exactly ``multiple`` backward passes and
    no partial accumulation is left at the end of an epoch. The passes beyond the reader's
    epoch wrap around the rank's shard (:func:`~spark_estimators.core.batches.epoch_batches`
    starts the epoch's order again), so every row is still read at least once per epoch and
    fewer than ``multiple`` extra batches are read per rank. (Horovod keeps the count and
    applies the partial accumulation at the end of the epoch; rounding down, as before, skipped
    rows, and with fewer reader steps than ``multiple`` read past the end of the epoch.)

    >>> import types
    >>> epoch_steps(types.SimpleNamespace(steps_per_epoch=2), None, multiple=3)
    3
    """
    if reader.steps_per_epoch is None:
        # A streaming reader before its data is all read: it counts the epoch itself, by the
        # same rule (data/stream_reader.py); None lets the epoch run until the reader ends it.
        cast("StreamBatchReader", reader).plan(limit, multiple)
        return None
    steps = int(reader.steps_per_epoch)
    if limit is not None:
        steps = min(steps, int(limit)) if steps else int(limit)
    if multiple > 1:
        steps = max(multiple, -(-steps // multiple) * multiple)
    return steps


# -- metrics --------------------------------------------------------------------------------------
@dataclass
class EpochSums:
    """One rank's running sums over an epoch: ``loss * rows``, ``rows``, ``metric * rows``."""

    metrics: int = 0
    loss: float = 0.0
    rows: float = 0.0
    metric_sums: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.metric_sums:
            self.metric_sums = [0.0] * self.metrics

    def add(self, loss: float, rows: float, metric_values: Sequence[float] = ()) -> None:
        """Add one batch: its mean loss, its rows and its mean metric values."""
        self.loss += float(loss) * rows
        self.rows += rows
        for i, value in enumerate(metric_values):
            self.metric_sums[i] += float(value) * rows

    def vector(self) -> np.ndarray:
        """``[loss sum, rows, *metric sums]`` as float64 (what the ranks add up)."""
        return np.array([self.loss, self.rows, *self.metric_sums], dtype=np.float64)


def epoch_means(totals: Sequence[float] | np.ndarray) -> list[float]:
    """``[loss, *metrics]`` means from summed ``[loss sum, rows, *metric sums]`` of all ranks."""
    rows = max(float(totals[1]), 1.0)
    return [float(totals[0]) / rows, *(float(v) / rows for v in totals[2:])]


def average_over_ranks(sums: EpochSums, name: str = "epoch_metrics") -> list[float]:
    """Row-weighted means of loss and metrics over all ranks (a collective: every rank calls it)."""
    from spark_estimators import collective

    return epoch_means(collective.allreduce(sums.vector(), op=collective.Sum, name=name))


def epoch_logs(
    epoch: int,
    names: Sequence[str],
    train: Sequence[float],
    val: Sequence[float] | None = None,
) -> dict[str, float]:
    """The epoch's logs: ``epoch``, ``loss``, the metrics, ``val_loss`` and ``val_`` + each."""
    logs: dict[str, float] = {"epoch": int(epoch), "loss": train[0]}
    logs.update(zip(names, train[1:], strict=True))
    if val is not None:
        logs["val_loss"] = val[0]
        logs.update({"val_" + n: v for n, v in zip(names, val[1:], strict=True)})
    return logs


def stop_together(stop: bool) -> bool:
    """True on every rank when any rank wants to stop (one allreduce; every rank calls it)."""
    from spark_estimators import collective

    flag = np.array([float(bool(stop))], dtype=np.float64)
    return bool(collective.allreduce(flag, op=collective.Max, name="stop_training")[0] > 0)


# -- events to the driver -------------------------------------------------------------------------
def send_event(kind: str, data: object) -> None:
    """Send an event (``"epoch"``, ``"first_batch"``) to the driver; nothing outside a run."""
    from spark_estimators.task import send_event as send

    send(kind, data)


class FirstBatchEvent:
    """Call after every training step: the first call sends ``first_batch`` (once, if enabled)."""

    def __init__(self, enabled: bool = True) -> None:
        self.pending = enabled

    def __call__(self) -> None:
        """Send the event on the first call."""
        if self.pending:
            self.pending = False
            send_event("first_batch", time.time())  # time to first batch, for the driver


# -- checkpoints ----------------------------------------------------------------------------------
def commit_epoch(
    store: StoreBase,
    run_id: str,
    framework: str,
    epoch: int,
    num_proc: int | None,
    history: Sequence[dict[str, float]],
    fingerprint: str | None,
    extra: Mapping[str, object] | None = None,
) -> None:
    """Rank 0, after the framework's checkpoint file is complete: write ``checkpoint.json``."""
    info = checkpoint.CheckpointInfo(
        framework=framework,
        epoch=int(epoch),
        num_proc=num_proc,
        history=tuple(history),
        fingerprint=fingerprint,
        extra=dict(extra or {}),
    )
    checkpoint.write_info(store, run_id, info)


def lr_rescale(scale_lr: bool, saved_size: int | None, size: int) -> float:
    """Factor for a restored learning rate that was scaled for ``saved_size`` ranks.

    With ``scale_lr`` the saved rate is ``lr * saved_size``; an elastic relaunch or a hot start
    with another ``num_proc`` needs ``lr * size``, keeping what a schedule did to it.
    """
    if not scale_lr or saved_size is None or saved_size == size:
        return 1.0
    return size / saved_size


# -- the result the driver gets -------------------------------------------------------------------
def row_shapes(outputs: object) -> list[tuple[int, ...]]:
    """Per-row shape of each model output (one array or tensor, or a list/tuple of them)."""
    from spark_estimators.core.tensors import output_row_shape

    outs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    arrays = [o.detach().cpu().numpy() if hasattr(o, "detach") else np.asarray(o) for o in outs]
    return [output_row_shape(a) for a in arrays]


def rank_result(
    rank: int,
    fingerprint: str,
    history: Sequence[dict[str, float]] | None = None,
    output_shapes: Sequence[tuple[int, ...]] | None = None,
    **payload: object,
) -> dict[str, object]:
    """What ``remote.train`` returns to the driver.

    Every rank: ``rank`` and ``fingerprint`` (the driver checks that all ranks end with the same
    weights). Rank 0 also: ``history``, ``output_shapes`` and ``payload`` (the trained weights or
    model and framework extras); other ranks' values for them are dropped.
    """
    result: dict[str, object] = {"rank": int(rank), "fingerprint": fingerprint}
    if rank == 0:
        result.update(
            history=list(history or []),
            output_shapes=list(output_shapes or []),
            **payload,
        )
    return result
