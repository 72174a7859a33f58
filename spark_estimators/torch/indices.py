"""Which floating columns ``TorchEstimator`` feeds as int64 class indices (driver side).

Spark encodes classes as doubles: ``StringIndexer`` (what our error for string columns tells
users to run) writes ``0.0, 1.0, ...``, which arrive on the ranks as float32. Torch's
classification losses and embedding layers want int64 there (``expected target dtype to be Long``,
``Expected tensor for argument #1 'indices' ... FloatTensor``). Keras casts such columns itself;
for torch the driver decides, once per fit, and the ranks and ``transform`` cast:

- a **label** column whose loss takes class indices: ``CrossEntropyLoss`` and
  ``F.cross_entropy`` for a scalar label (an array label stays float: class probabilities, torch's
  rule for float targets), ``NLLLoss``, ``MultiMarginLoss``, ``MultiLabelMarginLoss`` and their
  functional forms for any label (subclasses and ``functools.partial`` of them count);
- a **feature** column that reaches an ``nn.Embedding`` or ``nn.EmbeddingBag`` whole (the column
  itself or a reshaped view of it), found by one forward pass of the model in the driver on two
  rows of zeros with hooks on those layers (eval mode, no grad; the hooks are removed after).

Integer columns are int64 already and need nothing. A floating column chosen here must hold whole
numbers: :func:`check_whole_numbers` reads those columns of the prepared Parquet files in one
small Spark job before training starts and refuses fractional or NaN values with a
``ConfigurationError`` naming the column. A loss written as a plain function, an embedding
called functionally (``F.embedding``) or a column sliced before its embedding is not detected:
cast in the model (``x.long()``) or the loss there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spark_estimators.core import tensors
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from spark_estimators.data.metadata import ColumnInfo, DatasetMetadata
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexColumn:
    """A column fed as class indices, and why (for messages)."""

    name: str
    reason: str


def class_index_mode(loss: object) -> str:
    """``"any"``, ``"scalar"`` (label shapes it applies to) or ``""`` for a loss."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    fn = loss
    while isinstance(fn, functools.partial):
        fn = fn.func
    nn = torch.nn
    if isinstance(fn, nn.NLLLoss | nn.MultiMarginLoss | nn.MultiLabelMarginLoss) or any(
        fn is f for f in (F.nll_loss, F.multi_margin_loss, F.multilabel_margin_loss)
    ):
        return "any"
    if isinstance(fn, nn.CrossEntropyLoss) or fn is F.cross_entropy:
        return "scalar"
    return ""


def _loss_name(loss: object) -> str:
    from spark_estimators.torch.losses import metric_name

    while isinstance(loss, functools.partial) and not hasattr(loss, "__name__"):
        loss = loss.func
    return metric_name(loss)


def _floating(columns: Mapping[str, ColumnInfo], col: str) -> bool:
    info = columns.get(col)
    return info is not None and np.dtype(info.dtype).kind == "f"


def label_index_cols(
    losses: Sequence[object], label_cols: Sequence[str], columns: Mapping[str, ColumnInfo]
) -> list[IndexColumn]:
    """The floating label columns whose loss takes class indices."""
    per_label = list(losses) * len(label_cols) if len(losses) == 1 else list(losses)
    out = []
    for col, loss in zip(label_cols, per_label, strict=False):
        mode = class_index_mode(loss)
        if not mode or not _floating(columns, col):
            continue
        if mode == "scalar" and tuple(columns[col].shape) != ():
            continue
        out.append(IndexColumn(col, f"label of the loss {_loss_name(loss)}"))
    return out


def embedding_index_cols(
    model: torch.nn.Module,
    feature_cols: Sequence[str],
    columns: Mapping[str, ColumnInfo],
    input_shapes: Sequence[Sequence[int] | None] | None,
) -> list[IndexColumn]:
    """The floating feature columns that reach an ``nn.Embedding``/``nn.EmbeddingBag`` whole."""
    import torch

    if isinstance(model, torch.jit.ScriptModule):
        return []
    names: dict[torch.nn.Module, str] = {
        m: name or type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag)
    }
    floating = [c for c in feature_cols if _floating(columns, c)]
    if not names or not floating or any(c not in columns for c in feature_cols):
        return []
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    zeros = {c: np.zeros((2, *columns[c].shape), dtype=columns[c].dtype) for c in feature_cols}
    arrays = tensors.model_inputs(zeros, feature_cols, input_shapes)
    inputs = [torch.from_numpy(tensors.for_torch(a)).to(device) for a in arrays]
    by_storage = {
        t.untyped_storage().data_ptr(): (col, t.numel())
        for col, t in zip(feature_cols, inputs, strict=True)
        if col in floating
    }
    found: dict[str, str] = {}

    def cast_indices(
        module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        col, numel = by_storage.get(x.untyped_storage().data_ptr(), (None, -1))
        if col is not None and x.numel() == numel:
            found.setdefault(col, names[module])
        if args:
            return (x.long(), *args[1:]), kwargs
        return args, {**kwargs, "input": x.long()}

    handles = [m.register_forward_pre_hook(cast_indices, with_kwargs=True) for m in names]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            model(*inputs)
    except Exception as exc:  # noqa: BLE001 - the ranks report the model's own errors
        logger.debug("forward pass looking for embedding inputs failed: %r", exc)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
    return [
        IndexColumn(c, f"input of the layer {found[c]!r} ({_layer_type(model, found[c])})")
        for c in feature_cols
        if c in found
    ]


def _layer_type(model: torch.nn.Module, name: str) -> str:
    for n, m in model.named_modules():
        if (n or type(m).__name__) == name:
            return type(m).__name__
    return "embedding"


def check_whole_numbers(
    store: StoreBase, meta: DatasetMetadata | StreamMetadata, cols: Sequence[IndexColumn]
) -> None:
    """Refuse index columns with fractional or NaN values, reading the prepared files in Spark.

    One task per few files reads only ``cols`` (through the store's filesystem, as the ranks do);
    without a SparkContext (no session, or a Spark Connect client) the driver reads them itself.
    """
    if not cols:
        return
    names = [c.name for c in cols]
    paths = [f.path for split in ("train", "val") for f in meta.files(split)]
    if not paths:
        return
    remote = store.to_remote() if hasattr(store, "to_remote") else store
    count = functools.partial(fractional_in_file, remote, names)
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    try:
        sc = None if spark is None else spark.sparkContext
    except Exception:  # noqa: BLE001 - a Spark Connect client has no SparkContext
        sc = None
    if sc is None:
        results = [count(p) for p in paths]
    else:
        parts = max(1, min(len(paths), sc.defaultParallelism))
        sc.setJobDescription(f"spark_estimators: check class-index columns {names!r}")
        try:
            results = sc.parallelize(paths, parts).map(count).collect()
        finally:
            sc.setJobDescription(None)  # type: ignore[arg-type]
    for col in cols:
        bad = sum(r[col.name][0] for r in results)
        if bad:
            example = next(r[col.name][1] for r in results if r[col.name][0])
            raise ConfigurationError(
                f"column {col.name!r} is the {col.reason}, which needs integer class indices, "
                f"but {bad} of its values are not whole numbers (e.g. {example!r}); TorchEstimator "
                f"casts whole-number floats such as StringIndexer's output to int64. Encode the "
                f"column as class indices (StringIndexer, or cast it to int), or use a loss/layer "
                f"that takes float values"
            )


def fractional_in_file(
    store: StoreBase, cols: list[str], path: str
) -> dict[str, tuple[int, float]]:
    """``{col: (count of non-whole values, first such value)}`` of one Parquet file (executor)."""
    import pyarrow.parquet as pq

    out: dict[str, tuple[int, float]] = {c: (0, 0.0) for c in cols}
    with store.filesystem.open_input_file(store.fs_path(path)) as handle:
        for batch in pq.ParquetFile(handle).iter_batches(columns=cols):
            for col in cols:
                values = _flat_values(batch.column(col))
                bad = values != np.floor(values)
                n = int(bad.sum())
                if n:
                    count, example = out[col]
                    out[col] = (count + n, example if count else float(values[bad][0]))
    return out


def _flat_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Every number of an Arrow column (scalars, lists, sparse ``struct<..., values>``)."""
    import pyarrow as pa

    while True:
        if pa.types.is_struct(column.type):
            column = column.field("values")
        elif (
            pa.types.is_list(column.type)
            or pa.types.is_large_list(column.type)
            or pa.types.is_fixed_size_list(column.type)
        ):
            column = column.flatten()
        else:
            break
    values = column.to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=np.float64)
