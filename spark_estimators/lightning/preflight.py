"""A LightningModule's ``training_step`` on a few real rows, in the driver, before the job.

The Lightning counterpart of :mod:`spark_estimators.torch.preflight`: the module's own
``training_step`` (its forward and loss) runs once on the first rows of the prepared training
data, as the ranks batch them (``{column: tensor}``), on the CPU under ``torch.no_grad()`` in
eval mode; every sub-module's ``training`` flag is restored after. ``self.log`` calls are
ignored there (no Trainer is attached). Failures are reported with the fix first: class ids
stored as floating point for a classification loss, an output whose width differs from the
label's, or the step's own error with the batch's shapes. Skipped with a ``transformation_fn``
or a model not on the CPU; a step that needs its Trainer (``self.trainer``,
``self.optimizers()``) is not judged here (the ranks run it).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import pytorch_lightning as pl
    import torch

    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)


def check_training_step_on_rows(
    spec: TrainSpec,
    module: pl.LightningModule,
    store: StoreBase,
    meta: DatasetMetadata | StreamMetadata,
    custom_batches: bool,
) -> float:
    """Run ``module.training_step`` on a few rows; returns the milliseconds it took."""
    import torch

    if custom_batches or any(p.device.type != "cpu" for p in module.parameters()):
        return 0.0
    from spark_estimators.lightning.remote import LightningTrainSpec, converter
    from spark_estimators.torch.preflight import read_rows

    assert isinstance(spec, LightningTrainSpec)  # the lightning framework's spec
    start = time.perf_counter()
    rows = read_rows(store, meta, spec)
    if rows is None:
        return 0.0
    batch = converter(spec)(rows)
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                module.training_step(batch, 0)
                failure: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - explained below
                failure = exc
        size_warning = next((w for w in caught if "target size" in str(w.message).lower()), None)
        if failure is not None and "trainer" in str(failure).lower():
            return 0.0  # the step needs its Trainer: only the ranks can run it
        if failure is not None or size_warning is not None:
            raise _step_error(spec, module, batch, failure, size_warning) from failure
    finally:
        for sub, training in modes:
            sub.training = training
    return (time.perf_counter() - start) * 1000


def _step_error(
    spec: TrainSpec,
    module: object,
    batch: Mapping[str, torch.Tensor],
    failure: BaseException | None,
    size_warning: warnings.WarningMessage | None,
) -> Exception:
    shapes = ", ".join(
        f"{c!r} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for c, t in batch.items()
    )
    name = type(module).__name__
    cause = (
        f"{type(failure).__name__}: {failure}"
        if failure is not None or size_warning is None
        else f"{size_warning.category.__name__}: {size_warning.message}"
    )
    rows = len(next(iter(batch.values())))
    where = f"\n{name}.training_step ran in the driver on {rows} prepared rows ({shapes}): {cause}"
    text = str(failure or "").lower()
    if "target dtype" in text or "expected scalar type long" in text or "long or byte" in text:
        floating = [c for c in spec.label_cols if batch[c].is_floating_point()]
        col = (floating or list(spec.label_cols))[0]
        return ConfigurationError(
            f"the loss in {name}.training_step needs int64 class indices but label column "
            f"{col!r} holds floating point class ids: cast it first, "
            f"df.withColumn({col!r}, F.col({col!r}).cast('long')), or call .long() on it in "
            "training_step" + where
        )
    if size_warning is not None and failure is None:
        return ConfigurationError(
            f"the output of {name} and its label differ in size (the loss broadcast them, "
            "which gives wrong results): make the model's last layer output as many values per "
            f"row as the label column(s) {list(spec.label_cols)!r} hold" + where
        )
    return ConfigurationError(
        f"{name}.training_step failed on {rows} rows of the prepared data: {cause}. The batch "
        f"is a dict of column -> tensor ({shapes})" + where.split(":", 1)[0]
    )
