"""One forward and loss pass of the user's model on a few real rows, in the driver, before the job.

The common mistakes of a first fit fail here, each with the fix in the first line of the error,
instead of as a long traceback from every rank:

- several scalar ``feature_cols`` into a model whose ``forward`` takes one input (the model gets
  one input per feature column);
- a classification loss fed class ids stored as floating point (a loss other than a plain
  ``CrossEntropyLoss``/``NLLLoss`` object, which are cast for you);
- a model whose output width differs from its label's;
- any other failure of ``model(*inputs)`` or the loss, with the input shapes it got.

The rows are the first few of the prepared training data, converted exactly as the ranks convert
them. The pass runs on the CPU under ``torch.no_grad()`` with the model in eval mode, and every
sub-module's ``training`` flag is restored after, so the model's state (BatchNorm running
statistics included) is unchanged. It is skipped when the batches are not the prepared rows
(a ``transformation_fn``) or the step is the user's own (``train_minibatch_fn``), when the
model is not on the CPU, and when the rows cannot be read (then the ranks report any problem).
Its cost is a few milliseconds (one small Parquet read and a 4-row forward).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.store.base import StoreBase
    from spark_estimators.torch.losses import Loss

logger = logging.getLogger(__name__)

ROWS = 4


def read_rows(
    store: StoreBase, meta: DatasetMetadata | StreamMetadata, spec: TrainSpec, rows: int = ROWS
) -> dict[str, np.ndarray] | None:
    """The first ``rows`` prepared training rows of the spec's columns (``{column: ndarray}``).

    None when nothing can be read (a streaming fit prepares no files).
    """
    columns = list(spec.feature_cols) + list(spec.label_cols)
    if spec.sample_weight_col:
        columns.append(spec.sample_weight_col)
    if not getattr(meta, "train_files", None):
        return None  # nothing prepared to read (a streaming fit)
    from spark_estimators.data import make_batch_reader

    try:
        reader = make_batch_reader(
            store,
            cast("DatasetMetadata", meta),  # it has train files: prepared Parquet
            split="train",
            rank=0,
            size=1,
            batch_size=rows,
            columns=columns,
            shuffle=False,
            prefetch=0,
        )
        return reader.peek()
    except Exception as exc:  # noqa: BLE001 - the check is a courtesy; training reads the data
        logger.debug("preflight: could not read rows (%r); skipping the model check", exc)
        return None


def check_model_on_rows(
    spec: TrainSpec,
    model: object,
    losses: Sequence[Loss],
    store: StoreBase,
    meta: DatasetMetadata | StreamMetadata,
    custom_batches: bool,
) -> float:
    """Run the model and loss on a few rows in the driver; returns the milliseconds it took.

    ``losses``: one per label column; ``custom_batches``: a ``transformation_fn`` or
    ``train_minibatch_fn`` is set (then nothing is checked). Raises
    :class:`~spark_estimators.errors.ConfigurationError` with the fix first when the model or
    the loss fails on the rows.
    """
    if custom_batches:
        return 0.0
    import torch

    if not isinstance(model, torch.nn.Module) or any(
        p.device.type != "cpu" for p in model.parameters()
    ):
        return 0.0
    start = time.perf_counter()
    rows = read_rows(store, meta, spec)
    if rows is None:
        return 0.0
    from spark_estimators.torch import losses as loss_lib
    from spark_estimators.torch.remote import TorchTrainSpec, converter

    assert isinstance(spec, TorchTrainSpec)  # the torch framework's spec

    batch = converter(spec)(rows)
    inputs = [batch[c] for c in spec.feature_cols]
    labels = [batch[c] for c in spec.label_cols]
    weights = batch[spec.sample_weight_col] if spec.sample_weight_col else None
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            try:
                out = model(*inputs)
            except Exception as exc:  # noqa: BLE001 - explained, then raised with the cause
                raise _forward_error(spec, model, inputs, exc) from exc
            if len(loss_lib.as_list(out)) != len(labels):
                count = len(loss_lib.as_list(out))
                raise loss_lib.output_count_error(count, len(labels), spec.label_cols)
            outputs, matched = loss_lib.transform_outputs(out, labels)
            loss_fn = loss_lib.LossFn(
                losses, spec.loss_weights, weighted=bool(spec.sample_weight_col)
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    loss_fn(outputs, matched, weights)
                    failure: BaseException | None = None
                except Exception as exc:  # noqa: BLE001 - explained below
                    failure = exc
            size_warning = next(
                (w for w in caught if "target size" in str(w.message).lower()), None
            )
            if failure is not None or size_warning is not None:
                raise _loss_error(spec, outputs, labels, failure, size_warning) from failure
    finally:
        for module, training in modes:
            module.training = training
    ms = (time.perf_counter() - start) * 1000
    logger.debug("preflight: model and loss ran on %d rows in %.1f ms", len(inputs[0]), ms)
    return ms


def _shapes(spec: TrainSpec, tensors: Sequence[torch.Tensor], names: list[str]) -> str:
    return ", ".join(
        f"{name!r} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        for name, t in zip(names, tensors, strict=False)
    )


def _forward_error(
    spec: TrainSpec, model: torch.nn.Module, inputs: list[torch.Tensor], exc: BaseException
) -> Exception:
    features = list(spec.feature_cols)
    got = _shapes(spec, inputs, features)
    cause = f"{type(exc).__name__}: {exc}"
    name = type(model).__name__
    if isinstance(exc, TypeError) and "positional argument" in str(exc) and len(features) > 1:
        return ConfigurationError(
            f"feature_cols={features!r} are {len(features)} model inputs (one model input per "
            f"feature column: {name}.forward({', '.join(f'x{i}' for i in range(len(features)))}"
            ")), but its forward takes fewer: assemble them into one vector column with "
            f"VectorAssembler(inputCols={features!r}, outputCol='features') and "
            "feature_cols=['features'], or use a model whose forward takes "
            f"{len(features)} inputs.\nThe driver ran the model on {len(inputs[0])} rows of "
            f"the prepared data (inputs: {got}) before starting the job: {cause}"
        )
    return ConfigurationError(
        f"{name}(*inputs) failed on {len(inputs[0])} rows of the prepared data (inputs: {got}): "
        f"{cause}. Check that the model's first layer takes these shapes (input_shapes= "
        "reshapes a column; each feature column is one forward argument)"
    )


def _loss_error(
    spec: TrainSpec,
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    failure: BaseException | None,
    size_warning: warnings.WarningMessage | None,
) -> Exception:
    cause = (
        f"{type(failure).__name__}: {failure}"
        if failure is not None or size_warning is None
        else f"{size_warning.category.__name__}: {size_warning.message}"
    )
    label_cols = list(spec.label_cols)
    text = str(failure or "").lower()
    if "target dtype" in text or "expected scalar type long" in text or "long or byte" in text:
        floating = [
            c for c, lab in zip(label_cols, labels, strict=False) if lab.is_floating_point()
        ]
        col = floating[0] if floating else label_cols[0]
        return ConfigurationError(
            f"the loss needs int64 class indices but label column {col!r} holds floating "
            f"point class ids: cast it first, df.withColumn({col!r}, F.col({col!r})"
            ".cast('long')), or pass the loss as a torch.nn.CrossEntropyLoss()/NLLLoss() object "
            f"(its floating label columns are cast for you).\nThe loss said: {cause}"
        )
    for col, out, lab in zip(label_cols, outputs, labels, strict=False):
        width = int(out[0].numel()) if out.dim() > 0 and len(out) else 1
        label_width = int(lab[0].numel()) if lab.dim() > 0 and len(lab) else 1
        if width != label_width and lab.is_floating_point():
            return ConfigurationError(
                f"the model outputs {width} value(s) per row but label column {col!r} holds "
                f"{label_width}: make the model's last layer output {label_width} (e.g. "
                f"nn.Linear(..., {label_width})), or use a label with {width} values per row.\n"
                f"The driver ran the model and loss on {len(lab)} rows (outputs "
                f"{list(out.shape)}, label {list(lab.shape)}): {cause}"
            )
    return ConfigurationError(
        f"the loss failed on the model's outputs for {len(labels[0])} rows of the prepared data "
        f"(outputs: {_shapes(spec, outputs, label_cols)}; labels: "
        f"{_shapes(spec, labels, label_cols)}): {cause}"
    )
