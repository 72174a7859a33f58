"""TorchModel: the Transformer a TorchEstimator returns."""

from __future__ import annotations

from typing import Any

from spark_estimators.core import tensors
from spark_estimators.core.model import Predictor, SparkModel
from spark_estimators.torch.serialization import model_from_bytes, model_to_bytes


class TorchPredictor(Predictor):
    """Loads a pickled ``torch.nn.Module`` once per Python worker and predicts numpy batches."""

    def load(self, blob: bytes) -> Any:
        """The torch model from its bytes (TorchScript or pickled), in eval mode on this device."""
        import torch

        from spark_estimators.task import get_device

        model = model_from_bytes(blob)
        device = get_device()
        device = device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
        model = model.to(device)
        model.eval()
        return model

    def predict(self, model: Any, inputs: list[Any]) -> list[Any]:
        """Run the model on one batch of input arrays and return one array per output."""
        import torch

        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        with torch.no_grad():
            out = model(*[torch.from_numpy(tensors.for_torch(a)).to(device) for a in inputs])
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
    """

    def _model_to_bytes(self) -> bytes:
        return model_to_bytes(self._model)  # TorchScript modules through torch.jit.save

    def _model_from_bytes(self, blob: bytes) -> Any:
        model = model_from_bytes(blob)
        model.eval()
        return model

    def _predictor(self) -> Predictor:
        return TorchPredictor()
