"""LightningModel: the Transformer a LightningEstimator returns.

It behaves as :class:`~spark_estimators.torch.TorchModel`: ``transform(df)`` calls the module as
``module(*features)`` (one tensor per feature column, in ``feature_cols`` order, shaped by the
conventions of :mod:`spark_estimators.core.tensors`: a scalar column is ``[batch, 1]``), batched
with Arrow on the executors; ``getModel()`` returns the ``LightningModule`` on the CPU in eval
mode. In addition ``getLoggedMetrics()`` returns rank 0's ``trainer.logged_metrics`` at the end
of training (what horovod's Lightning estimator returned).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from spark_estimators.errors import ConfigurationError
from spark_estimators.torch.model import TorchModel

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class LightningModel(TorchModel):
    """A trained ``LightningModule`` as a Spark ML Transformer.

    ``getHistory()`` holds one dict per epoch: ``epoch``, every scalar the module logged
    (``trainer.callback_metrics``) and ``loss`` (the mean loss ``training_step`` returned), each
    averaged over the ranks. ``write().save(path)`` / ``LightningModel.load(path)`` and Pipeline
    persistence work as for any Spark ML model, verified before unpickling as for ``TorchModel``
    (docs/security.md).
    """

    def __init__(
        self,
        *,
        logged_metrics: dict[str, float] | None = None,
        forward_error: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Take the Lightning-only state; the other keywords are as for SparkModel.

        ``logged_metrics`` are rank 0's ``trainer.logged_metrics``; ``forward_error`` is why the
        module cannot be called on the feature tensors (``transform`` then explains it).
        """
        super().__init__(**kwargs)
        self._logged_metrics = dict(logged_metrics or {})
        self._forward_error = forward_error

    def getLoggedMetrics(self) -> dict[str, float]:
        """Rank 0's ``trainer.logged_metrics`` after the last epoch, as floats."""
        return dict(self._logged_metrics)

    def _extra_state(self) -> dict[str, object]:
        state = super()._extra_state()
        state["logged_metrics"] = self._logged_metrics
        state["forward_error"] = self._forward_error
        return state

    def _restore_extra_state(self, state: dict[str, object]) -> None:
        super()._restore_extra_state(state)
        self._logged_metrics = dict(cast("dict[str, float]", state.get("logged_metrics", {})))
        self._forward_error = cast("str | None", state.get("forward_error"))

    def _transform(self, df: DataFrame) -> DataFrame:
        if self._forward_error is not None:
            raise ConfigurationError(
                "transform calls the module as module(*feature_tensors), one tensor per "
                f"feature column {self.getFeatureCols()!r}, but that failed after training: "
                f"{self._forward_error}. Define forward(self, *features) to accept them."
            )
        return super()._transform(df)
