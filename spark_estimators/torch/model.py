"""TorchModel: the Transformer a TorchEstimator returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from pyspark.ml.param import Param, Params, TypeConverters

from spark_estimators.core import tensors
from spark_estimators.core.model import Predictor, SparkModel
from spark_estimators.torch.serialization import model_from_bytes, model_to_bytes

if TYPE_CHECKING:
    import numpy as np
    import torch


class TorchPredictor(Predictor):
    """Loads a pickled ``torch.nn.Module`` once per Python worker and predicts numpy batches.

    ``index_inputs`` maps input positions to column names fed as int64 class indices (the
    ``indexCols`` a fit chose: columns that feed an ``nn.Embedding``).
    """

    def __init__(self, index_inputs: dict[int, str] | None = None) -> None:
        self.index_inputs = dict(index_inputs or {})

    def load(self, blob: bytes) -> torch.nn.Module:
        """The torch model from its bytes (TorchScript or pickled), in eval mode on this device."""
        import torch

        from spark_estimators.task import get_device

        model = model_from_bytes(blob)
        device = get_device()
        device = device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
        model = model.to(device)
        model.eval()
        return model

    def predict(self, model: object, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run the model on one batch of input arrays and return one array per output."""
        import torch

        model = cast("torch.nn.Module", model)  # what load() returned
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        arrays = [
            tensors.as_index_array(a, self.index_inputs[i]) if i in self.index_inputs else a
            for i, a in enumerate(inputs)
        ]
        with torch.no_grad():
            out = model(*[torch.from_numpy(tensors.for_torch(a)).to(device) for a in arrays])
        outs = list(out) if isinstance(out, list | tuple) else [out]
        return [o.detach().cpu().double().numpy() for o in outs]


class TorchModel(SparkModel):
    """A trained torch model as a Spark ML Transformer.

    ``transform(df)`` appends one column per output (``<label>__output`` by default);
    ``getModel()`` returns the ``torch.nn.Module`` (on the CPU, in eval mode);
    ``getHistory()`` the per-epoch metrics; ``write().save(path)`` / ``TorchModel.load(path)``
    and Pipeline persistence work as for any Spark ML model.

    Loading unpickles the module, which can run code: load only models you trust. ``load``
    checks the SHA-256 (and, with ``key=`` or ``SPARK_ESTIMATORS_MODEL_KEY``, the HMAC) recorded
    at save before unpickling and raises ``ModelIntegrityError`` on a mismatch (docs/security.md).

    ``indexCols`` names the feature columns fed as int64 class indices (set by the fit for
    floating columns that feed an ``nn.Embedding``, e.g. ``StringIndexer`` output).
    """

    indexCols: Param[list[str]] = Param(
        Params._dummy(),
        "indexCols",
        "feature columns cast to int64 class indices before the model (floating columns that "
        "feed an nn.Embedding/EmbeddingBag; set by TorchEstimator.fit)",
        typeConverter=TypeConverters.toListString,
    )

    def getIndexCols(self) -> list[str]:
        """The feature columns fed as int64 class indices (``[]`` when none)."""
        if not self.isDefined(self.indexCols):
            return []
        cols: list[str] = self.getOrDefault(self.indexCols)
        return list(cols)

    def setIndexCols(self, value: list[str]) -> TorchModel:
        """Sets the value of ``indexCols``."""
        return self._set(indexCols=value)

    def _model_to_bytes(self) -> bytes:
        return model_to_bytes(self._model)  # TorchScript modules through torch.jit.save

    def _model_from_bytes(self, blob: bytes) -> torch.nn.Module:
        model = model_from_bytes(blob)
        model.eval()
        return model

    def _predictor(self) -> Predictor:
        index_cols = set(self.getIndexCols())
        features = self.getFeatureCols()
        return TorchPredictor({i: c for i, c in enumerate(features) if c in index_cols})
