"""What a deep-learning framework adds to a fit: the :class:`Framework` protocol.

A fit is one :class:`~spark_estimators.core.training_run.TrainingRun` (checks, data, spec,
launch, relaunch, result; read it top to bottom in ``core/training_run.py``). At a few points it
asks the estimator's framework for what only that framework knows; torch, keras and lightning
each implement this protocol next to their estimator (``TorchFramework`` in
``torch/estimator.py``, ``KerasFramework``, ``LightningFramework``):

========================  =====================================================================
``name``                  "torch", "keras" or "lightning": the ``checkpoint.json`` tag, the
                          zygote's imports, the MLflow flavour
``trainer()``             the rank entry point, ``<framework>/remote.train(spec) -> dict``
``rank_env()``            environment variables for the ranks of the default backend
``shipped()``             the user's objects that travel to the ranks pickled by value, and the
                          objects whose modules travel with them (user code by value)
``build_spec(...)``       the framework's TrainSpec: the shared fields plus its own
``check_spec(...)``       the driver-side run of the model on a few rows (first-fit mistakes
                          fail before any Spark job); the milliseconds it took
``build_model(...)``      the fitted Spark ML Model from the ranks' results
========================  =====================================================================

A framework object is made for one fit, so it may keep what one step learned for a later one
(torch: the class-index columns found while building the spec become the model's
``indexCols``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeAlias, TypeVar

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_estimators.core.checkpoint import CheckpointInfo
    from spark_estimators.core.model import SparkModel
    from spark_estimators.core.spec import TrainSpec
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.store.base import Store

__all__ = ["Fit", "FitData", "Framework", "FrameworkBase", "RankResult", "extend_spec"]

#: What one rank's ``train(spec)`` returns (see :func:`spark_estimators.core.rank.rank_result`).
RankResult: TypeAlias = dict[str, Any]
#: A fit's data as the driver knows it: a prepared Parquet dataset, or ``data="stream"``'s.
FitData: TypeAlias = "DatasetMetadata | StreamMetadata"

SpecT = TypeVar("SpecT", bound="TrainSpec")
EstT = TypeVar("EstT")


class Framework(Protocol):
    """The framework-specific steps of a fit (see the module docstring for the table)."""

    name: str

    def trainer(self) -> Callable[..., RankResult]:
        """The rank entry point: a module-level ``train(spec) -> dict`` run on every rank."""
        ...

    def rank_env(self) -> dict[str, str]:
        """Environment variables for the ranks of the default backend (``{}``: none)."""
        ...

    def shipped(self) -> tuple[object, list[object]]:
        """``(user objects, roots)``: pickled by value together with the roots' modules.

        The TrainingRun adds the roots of the Params every estimator has (``callbacks``,
        ``transformation_fn``); a framework names those of its own objects.
        """
        ...

    def build_spec(
        self, shared: TrainSpec, data: FitData, store: Store, info: CheckpointInfo | None
    ) -> TrainSpec:
        """The framework's spec: ``shared`` (see :func:`extend_spec`) plus its own fields.

        ``info`` is the run's ``checkpoint.json`` (None: a fresh run).
        """
        ...

    def check_spec(self, spec: TrainSpec, store: Store, data: FitData) -> float:
        """Run the model on a few rows in the driver; the milliseconds it took (0: skipped)."""
        ...

    def build_model(self, results: list[RankResult], run_id: str) -> SparkModel:
        """The fitted Model from the ranks' results (rank 0's first)."""
        ...


class FrameworkBase(Generic[EstT]):
    """What every :class:`Framework` starts from: the estimator it serves, ``est``.

    Its :meth:`rank_env` adds nothing to the backend's environment (keras overrides it).
    """

    def __init__(self, est: EstT) -> None:
        self.est = est

    def rank_env(self) -> dict[str, str]:
        """No extra environment: the ranks take the backend's."""
        return {}


class Fit(Protocol):
    """What an estimator's ``_fit`` and ``fit_on_parquet`` call: a TrainingRun.

    Declared here so that ``core/estimator.py`` names the type without importing
    ``core/training_run.py``, which imports it.
    """

    def fit(self, df: DataFrame) -> SparkModel:
        """Train on ``df`` (prepared to Parquet, or streamed)."""
        ...

    def fit_on_parquet(self, dataset_idx: str | None = None) -> SparkModel:
        """Train on a dataset already in the store."""
        ...


def extend_spec(shared: TrainSpec, spec_type: type[SpecT], **own: object) -> SpecT:
    """A ``spec_type`` (a TrainSpec subclass) with the ``shared`` fields and the framework's own.

    ``own`` may also replace a shared field (torch sets ``index_cols``).
    """
    fields = dict(vars(shared))
    fields.update(own)
    return spec_type(**fields)
