"""MLflow tracking of a fit (optional extra ``spark-estimators[mlflow]``; needs ``mlflow-skinny``).

When it logs (estimator param ``log_to_mlflow``):

- ``None`` (default): when an MLflow run is active in the thread that calls ``fit``
  (``with mlflow.start_run(): est.fit(df)``); nothing is imported or logged otherwise.
- ``True``: always; the active run, or a new run named after the fit's ``run_id`` that the fit
  ends (status FINISHED, or FAILED when training fails). Refused in the driver when mlflow is
  not installed.
- ``False``: never.

MLflow autologging (``mlflow.autolog()``, ``mlflow.pyspark.ml.autolog()``, or the framework's
``mlflow.pytorch`` / ``mlflow.keras`` / ``mlflow.tensorflow`` autologging; Databricks turns it on
by default): our estimators are **not** pyspark.ml autologging targets. Their ``fit`` bypasses
the ``Estimator.fit`` that pyspark.ml autologging patches (``SparkEstimator.fit``), because that
patch logs every Param by ``str(value)`` (the whole module's repr as ``model``; the optimizer
and loss reprs, which differ from ours, so logging ours failed with MLflow's "Changing param
values is not allowed"), persists the input DataFrame, logs its schema, and then warns that it
cannot log our model. The fit does its own logging in place of autologging's: with such
autologging on, ``None`` logs like ``True`` (a run of its own when none is active, one run per
fit, FINISHED or FAILED by the fit); ``False`` still logs nothing. The framework autologgers
would never see the training (it runs in the rank processes, not in the driver where they patch
``Trainer.fit`` / ``Model.fit``), so the fit's own metrics and model stand for theirs.
Inside a run that autologging started for another stage (a ``Pipeline`` or ``CrossValidator``
holding the estimator), each fit logs into a nested run of that run, so params of different
fits (a grid's) never clash.

What it logs, all from the driver: the estimator's params (values of simple types as they are,
objects such as the model or optimizer by class name), the tag ``spark_estimators.run_id``; each
epoch's metrics as rank 0 reports them (``step`` = the history entry's 0-based ``epoch``, the
same numbers as ``model.getHistory()``, one point per step; the last epoch's are logged with
the model, linked to it; characters MLflow refuses in a name, e.g. ``<lambda>``, become ``_``);
and the trained framework model with its signature (inferred from a few prepared training rows
and the model's outputs on them, as tensor specs with the batch dimension -1) under the artifact
path ``model`` (``mlflow.pytorch`` for Torch and Lightning models, ``mlflow.keras`` for Keras).
Metrics arrive on the driver service's thread, so they go through ``MlflowClient`` with the
run's id rather than the thread-local "active run".
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import numpy as np

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.models import ModelSignature
    from mlflow.tracking import MlflowClient
    from mlflow.types import Schema
    from pyspark.ml.param import Params

    from spark_estimators.core.framework import FitData
    from spark_estimators.core.model import SparkModel
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.store.base import Store

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class FeatureParams(Protocol):
    """The estimator params the example inputs of a logged model need."""

    def getFeatureCols(self) -> list[str]:
        """The feature columns, in the model's input order."""
        ...

    def getInputShapes(self) -> list[list[int] | None] | None:
        """The shape of each feature column's batch (None: as read)."""
        ...


RUN_ID_TAG = "spark_estimators.run_id"
_MAX_PARAM_CHARS = 500
_EXAMPLE_ROWS = 5


def check_available(flag: bool | None) -> None:
    """Driver-side check of ``log_to_mlflow`` before any Spark job."""
    if flag is not None and not isinstance(flag, bool):
        raise ConfigurationError(f"log_to_mlflow={flag!r} is invalid: expected None, True or False")
    if flag:
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            raise ConfigurationError(
                "log_to_mlflow=True needs MLflow: pip install 'spark-estimators[mlflow]' "
                "(or set log_to_mlflow=None to log only when mlflow is installed and a run is "
                "active)"
            ) from exc


def metric_key(name: str) -> str:
    """An MLflow-valid metric name: characters other than letters, digits and ``_-. /`` -> ``_``."""
    return re.sub(r"[^\w\-. /]", "_", name)


def _param_value(value: object) -> str | int | float | bool | None:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(
        v is None or isinstance(v, bool | int | float | str | list | tuple) for v in value
    ):
        return str(list(value))[:_MAX_PARAM_CHARS]
    if isinstance(value, list | tuple):
        return str([type(v).__name__ for v in value])[:_MAX_PARAM_CHARS]
    return type(value).__name__


#: The tag MLflow's autologging sets on a run it starts.
_AUTOLOG_TAG = "mlflow.autologging"
#: The MLflow autologging integrations whose being on makes a fit log (estimator class -> names).
_FLAVORS = {
    "TorchEstimator": ("pyspark.ml", "pytorch"),
    "LightningEstimator": ("pyspark.ml", "pytorch"),
    "KerasEstimator": ("pyspark.ml", "keras", "tensorflow"),
}
_DEFAULT_FLAVORS = ("pyspark.ml",)


def _flavors(est: object) -> Sequence[str]:
    for cls in type(est).__mro__:  # a user's subclass of TorchEstimator is a TorchEstimator
        if cls.__name__ in _FLAVORS:
            return _FLAVORS[cls.__name__]
    return _DEFAULT_FLAVORS


def autologging_on(integrations: Sequence[str] | None = None) -> bool:
    """Whether one of MLflow's autologging ``integrations`` is on in this process.

    ``mlflow.autolog()`` turns on each integration whose library is imported (and the others
    when they are); ``mlflow.<flavor>.autolog(disable=True)`` turns one off.
    """
    if "mlflow" not in sys.modules:
        return False
    try:
        from mlflow.utils.autologging_utils import autologging_is_disabled
    except ImportError:  # an MLflow without it has no autologging we know of
        return False
    return any(not autologging_is_disabled(name) for name in integrations or _DEFAULT_FLAVORS)


class MlflowTracker:
    """Logs one fit into an MLflow run; made by :meth:`for_fit` (None when not logging)."""

    def __init__(self, client: MlflowClient, mlflow_run_id: str, owns_run: bool):
        self.client = client
        self.mlflow_run_id = mlflow_run_id
        self.owns_run = owns_run
        # The latest epoch's metrics wait for the model (see log_model) or the end of the fit.
        self._pending: list[Metric] = []

    @classmethod
    def for_fit(cls, est: Params, run_id: str) -> MlflowTracker | None:
        """The tracker of a fit, or None when it is not to log to MLflow."""
        flag = est.getOrDefault("logToMlflow")
        if flag is False or (flag is None and "mlflow" not in sys.modules):
            return None  # without mlflow imported no run can be active
        import mlflow

        active = mlflow.active_run()
        if active is None and not flag and not autologging_on(_flavors(est)):
            return None
        client = mlflow.tracking.MlflowClient()
        # A Pipeline's or CrossValidator's autologging run: this fit gets a child run of it.
        nested = active is not None and _AUTOLOG_TAG in client.get_run(active.info.run_id).data.tags
        owns = active is None or nested
        run = mlflow.start_run(run_name=run_id, nested=nested) if owns else active
        assert run is not None
        tracker = cls(client, run.info.run_id, owns)
        tracker.log_params(est, run_id)
        return tracker

    def log_params(self, est: Params, run_id: str) -> None:
        """Log the estimator's params (not the store or backend) and the run id as a tag."""
        from mlflow.entities import Param, RunTag

        params = []
        for param, value in sorted(est.extractParamMap().items(), key=lambda kv: kv[0].name):
            if param.name in ("store", "backend", "logToMlflow"):
                continue
            params.append(Param(param.name, str(_param_value(value))))
        self.client.log_batch(
            self.mlflow_run_id,
            params=params,
            tags=[
                RunTag(RUN_ID_TAG, run_id),
                RunTag("spark_estimators.estimator", type(est).__name__),
            ],
        )

    def log_epoch(self, logs: dict[str, float]) -> None:
        """One epoch's metrics (rank 0's, averaged over the ranks) at ``step`` = epoch.

        Each epoch's metrics are sent when the next epoch arrives; the last epoch's go with the
        model (:meth:`log_model`) or at :meth:`end`, so each step has exactly one point.
        """
        from mlflow.entities import Metric

        step = int(logs.get("epoch", 0))
        now = int(time.time() * 1000)
        metrics = [
            Metric(metric_key(key), float(value), now, step)
            for key, value in logs.items()
            if key != "epoch" and isinstance(value, int | float) and not isinstance(value, bool)
        ]
        self.flush()
        self._pending = metrics

    def flush(self, model_id: str | None = None) -> None:
        """Send the waiting epoch's metrics (linked to the logged model ``model_id`` if given)."""
        from mlflow.entities import Metric

        pending, self._pending = self._pending, []
        if model_id is not None:
            pending = [
                Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id) for m in pending
            ]
        if pending:
            self.client.log_batch(self.mlflow_run_id, metrics=pending)

    def log_model(
        self, est: FeatureParams, model: SparkModel, meta: FitData, store: Store, framework: str
    ) -> None:
        """The trained framework model with its signature, under the artifact path ``model``.

        It is logged at the last epoch's step, and that epoch's metrics are then logged linked
        to it: the logged model carries the final metrics (MLflow's ``log_model`` would copy the
        metrics already logged at its ``step``, by default 0, as a second point of that step).
        """
        import mlflow

        inputs = _example_inputs(est, meta, store, getattr(model, "getIndexCols", list)())
        net = model.getModel()
        step = self._pending[0].step if self._pending else 0
        info = self._log_model(mlflow, est, model, net, inputs, framework, step)
        self.flush(model_id=getattr(info, "model_id", None))

    def _log_model(
        self,
        mlflow: ModuleType,
        est: FeatureParams,
        model: SparkModel,
        net: object,
        inputs: list[np.ndarray],
        framework: str,
        step: int,
    ) -> object:
        info = None
        with _in_run(mlflow, self.mlflow_run_id):
            if framework in ("torch", "lightning"):
                _import_mlflow_pytorch()
                import mlflow.pytorch
                import torch

                with torch.no_grad():
                    out = cast(torch.nn.Module, net)(*[torch.from_numpy(a) for a in inputs])
                outputs = [o.detach().cpu().numpy() for o in _as_list(out)]
                # Pickle format: it saves any module (scripted ones too) with a dynamic batch
                # size, where pt2 needs a torch.export trace of one example batch. MLflow logs a
                # caution about pickle on every save; the model is the user's own, so not here.
                pytorch_log = logging.getLogger("mlflow.pytorch")
                level = pytorch_log.level
                pytorch_log.setLevel(logging.ERROR)
                try:
                    info = mlflow.pytorch.log_model(
                        net,
                        name="model",
                        step=step,
                        signature=signature(
                            est.getFeatureCols(), inputs, model.output_cols(), outputs
                        ),
                        serialization_format="pickle",
                        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                    )
                finally:
                    pytorch_log.setLevel(level)
            elif framework == "keras":
                import keras
                import mlflow.keras

                out = cast(keras.Model, net).predict(
                    inputs[0] if len(inputs) == 1 else inputs, verbose=0
                )
                outputs = [np.asarray(o) for o in _as_list(out)]
                info = mlflow.keras.log_model(
                    net,
                    name="model",
                    step=step,
                    signature=signature(est.getFeatureCols(), inputs, model.output_cols(), outputs),
                    pip_requirements=[f"keras=={keras.__version__}"],
                )
        return info

    def end(self, failed: bool = False) -> None:
        """End the MLflow run this tracker started (FAILED or FINISHED); leave a user's run open."""
        try:
            self.flush()  # the last epoch's metrics when no model was logged
        except Exception as exc:  # noqa: BLE001 - tracking must not fail the fit
            logger.warning("could not record the last epoch's metrics: %r", exc)
        if self.owns_run:
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.mlflow_run_id:
                mlflow.end_run("FAILED" if failed else "FINISHED")
            else:
                self.client.set_terminated(self.mlflow_run_id, "FAILED" if failed else "FINISHED")


class _in_run:  # noqa: N801 - used like a function
    """Make ``mlflow_run_id`` the active run of this thread for the block (log_model needs one)."""

    def __init__(self, mlflow: ModuleType, mlflow_run_id: str):
        self.mlflow, self.run_id, self.started = mlflow, mlflow_run_id, False

    def __enter__(self) -> None:
        active = self.mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            self.mlflow.start_run(run_id=self.run_id, nested=active is not None)
            self.started = True

    def __exit__(self, *exc: object) -> None:
        if self.started:
            # Leave the run's status alone: ending here only pops it from this thread's stack.
            self.mlflow.end_run(status=self.mlflow.get_run(self.run_id).info.status)


def _import_mlflow_pytorch() -> None:
    """Import ``mlflow.pytorch`` without MLflow's warning about its own circular import.

    ``mlflow.pytorch`` imports pytorch_lightning when installed; with ``mlflow.autolog()`` on, that
    import runs MLflow's Lightning autologging hook inside the half-imported ``mlflow.pytorch``,
    which fails with a WARNING (and leaves Lightning autologging off). Lightning imported first,
    the hook runs before and succeeds.
    """
    # mlflow.autolog() turns "pytorch" on only once Lightning is imported: pyspark.ml stands in.
    if "mlflow.pytorch" in sys.modules or not autologging_on(("pyspark.ml", "pytorch")):
        return
    import importlib.util

    if "pytorch_lightning" not in sys.modules and importlib.util.find_spec("pytorch_lightning"):
        importlib.import_module("pytorch_lightning")


def _as_list(out: _T | list[_T] | tuple[_T, ...]) -> list[_T]:
    return list(out) if isinstance(out, list | tuple) else [out]


def signature(
    input_names: list[str],
    inputs: Sequence[np.ndarray],
    output_names: list[str],
    outputs: Sequence[np.ndarray],
) -> ModelSignature:
    """An MLflow tensor signature: one spec per input/output, the batch dimension as -1.

    Built directly (``infer_signature`` needs scipy, which ``mlflow-skinny`` lacks); several
    inputs or outputs are named by their columns.
    """
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    def schema(names: list[str], arrays: Sequence[np.ndarray]) -> Schema:
        return Schema(
            [
                TensorSpec(
                    np.asarray(a).dtype,
                    (-1, *np.asarray(a).shape[1:]),
                    name if len(arrays) > 1 else None,
                )
                for name, a in zip(names, arrays, strict=False)
            ]
        )

    return ModelSignature(inputs=schema(input_names, inputs), outputs=schema(output_names, outputs))


def _example_inputs(
    est: FeatureParams, meta: FitData, store: Store, index_cols: Sequence[str] = ()
) -> list[np.ndarray]:
    """A few prepared training rows as the model's inputs (what training fed it).

    ``index_cols``: the feature columns the model takes as int64 class indices (TorchModel's).
    """
    from spark_estimators.core import tensors
    from spark_estimators.data import make_batch_reader

    if getattr(meta, "streamed", False):  # data="stream": no prepared files, rows from the df
        rows = cast("StreamMetadata", meta).peek(list(est.getFeatureCols()), _EXAMPLE_ROWS)
    else:
        rows = make_batch_reader(
            store,
            cast("DatasetMetadata", meta),
            split="train",
            rank=0,
            size=1,
            batch_size=_EXAMPLE_ROWS,
            columns=list(est.getFeatureCols()),
            shuffle=False,
            prefetch=0,
        ).peek()
    return tensors.model_inputs(
        rows, est.getFeatureCols(), est.getInputShapes(), index_cols=index_cols
    )
