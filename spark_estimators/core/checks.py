"""Driver-side checks of what a user passes to ``fit``, each failing with the value and the fix.

They run before any Spark job (the input's type, a model class instead of a model, an object
that cannot travel to the ranks), or translate a Spark failure into the error a user can act on
(null vectors, which Spark reports as a raw JVM error from ``vector_to_array``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from spark_estimators.errors import ConfigurationError, TrainingFailedError

if TYPE_CHECKING:
    from types import ModuleType

    from pyspark.sql import DataFrame

    from spark_estimators.core.framework import RankResult

logger = logging.getLogger(__name__)

__all__ = [
    "check_dataframe",
    "check_fingerprints",
    "check_model_object",
    "check_session_active",
    "cap_batch_size",
    "explain_null_vectors",
    "import_framework",
    "null_vector_error",
    "unpicklable_error",
]

_MAX_DEPTH = 8


def import_framework(module: str, needs: str, extra: str) -> ModuleType:
    """Import the framework ``module``; without it, fail with ``"<needs>: pip install '<extra>'"``.

    E.g. ``import_framework("torch", "TorchEstimator needs PyTorch", "spark-estimators[torch]")``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{needs}: pip install '{extra}'") from exc


def check_dataframe(df: object, estimator: str) -> None:
    """Refuse anything but a Spark DataFrame (classic or Connect), naming how to make one."""
    module = type(df).__module__ or ""
    if module.startswith("pyspark.") and hasattr(df, "schema"):
        return
    kind = f"{module}.{type(df).__qualname__}" if module else type(df).__qualname__
    if module.startswith("pandas"):
        fix = "convert it first: est.fit(spark.createDataFrame(pdf))"
    elif module.startswith("pyspark.pandas"):
        fix = "convert it first: est.fit(psdf.to_spark())"
    else:
        fix = "pass a Spark DataFrame (spark.read..., spark.createDataFrame(...))"
    raise ConfigurationError(f"{estimator}.fit got a {kind}, not a pyspark.sql.DataFrame: {fix}")


def check_session_active(df: DataFrame, estimator: str) -> None:
    """Refuse a DataFrame whose SparkSession was stopped (``spark.stop()``), before any job.

    Spark would fail later, in the middle of preparing the data, with a JVM error about a
    stopped SparkContext (or a ``NoneType`` error from pyspark).
    """
    try:
        sc = df.sparkSession.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect: no SparkContext, the server says
        return
    if getattr(sc, "_jsc", True) is None:
        raise ConfigurationError(
            f"{estimator}.fit got a DataFrame of a stopped SparkSession (spark.stop() was "
            "called): start a new session (SparkSession.builder.getOrCreate()) and build the "
            "DataFrame again from it"
        )


def check_model_object(model: object) -> None:
    """A class passed as ``model=`` (``model=Net``) instead of an instance (``model=Net()``)."""
    if isinstance(model, type):
        name = model.__name__
        raise ConfigurationError(
            f"model={name} is a class, not a model: pass an instance, model={name}(...), and "
            "build the optimizer on that instance's parameters"
        )


def cap_batch_size(batch_size: int, rows: int, num_proc: int, name: str = "batch_size") -> int:
    """``batch_size``, or the rows of one rank's shard when the batch would hold more.

    A batch larger than a rank's shard would be filled by wrapping around the shard's rows again
    and again (``batch_size=10**9`` on 256 rows never finishes): such a batch is the whole shard.
    """
    if rows <= 0 or num_proc <= 0:
        return batch_size
    per_rank = -(-rows // num_proc)
    if batch_size <= per_rank:
        return batch_size
    logger.info(
        "%s=%d is larger than a rank's share of the data (%d rows / %d ranks = %d): each batch "
        "is the rank's whole shard, %d rows",
        name,
        batch_size,
        rows,
        num_proc,
        per_rank,
        per_rank,
    )
    return per_rank


@contextlib.contextmanager
def explain_null_vectors(df: DataFrame, columns: Sequence[str]) -> Iterator[None]:
    """Re-raise Spark's null-vector failure inside the block as :func:`null_vector_error`'s."""
    try:
        yield
    except Exception as exc:
        clear = null_vector_error(exc, df, columns)
        if clear is None:
            raise
        raise clear from exc


def null_vector_error(
    exc: BaseException, df: DataFrame, columns: Sequence[str]
) -> Exception | None:
    """The ConfigurationError for a Spark failure caused by null vectors, else None.

    Spark's ``vector_to_array`` fails on a null vector with a JVM error; the columns are
    counted only then (one Spark job, on the failure path only).
    """
    if "vector_to_array requires a non-null input" not in str(exc):
        return None
    from pyspark.sql import functions as F

    try:
        row = df.select([F.sum(F.col(c).isNull().cast("long")).alias(c) for c in columns]).first()
        assert row is not None  # an aggregate has one row
        counts = {c: int(row[c] or 0) for c in columns}
    except Exception:  # noqa: BLE001 - the count is a courtesy; the original error stays
        counts = {}
    found = {c: n for c, n in counts.items() if n}
    detail = ", ".join(f"{c!r}: {n}" for c, n in found.items()) or repr(list(columns))
    return ConfigurationError(
        f"null vectors in rows of column(s) {detail} (rows per column); drop them first: "
        f"df.na.drop(subset={list(found) or list(columns)!r})"
    )


def unpicklable_error(objects: Mapping[str, object], exc: BaseException) -> ConfigurationError:
    """Name the attribute path that cannot be pickled (``model.lock: _thread.lock``)."""
    found = None
    for name, obj in objects.items():
        found = _find_unpicklable(obj, name, 0)
        if found is not None:
            break
    if found is None:
        return ConfigurationError(
            f"the training objects cannot be pickled to send them to the ranks: {exc}"
        )
    path, value = found
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return ConfigurationError(
        f"{path} cannot be pickled to send it to the ranks: {path}: {kind} ({exc}). Remove it "
        "before fit, create it when first used on the rank, or give its class __getstate__/"
        "__setstate__ that leave it out"
    )


def _dumps(obj: object) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure means "not picklable"
        return False
    return True


def _children(obj: object, path: str) -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            yield f"{path}[{i}]", value
        return
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return
    for key, value in state.items():
        if key in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
            # torch.nn.Module: its sub-modules/parameters read as attributes (model.encoder)
            for sub, item in value.items():
                yield f"{path}.{sub}", item
        else:
            yield f"{path}.{key}", value


def _find_unpicklable(obj: object, path: str, depth: int) -> tuple[str, object] | None:
    """The deepest attribute path under ``obj`` that fails to pickle, or None if it pickles."""
    if _dumps(obj):
        return None
    if depth < _MAX_DEPTH:
        for child_path, child in _children(obj, path):
            found = _find_unpicklable(child, child_path, depth + 1)
            if found is not None:
                return found
    return path, obj


def check_fingerprints(results: list[RankResult]) -> list[str]:
    """Every rank must end with the same parameters; returns the fingerprints by rank.

    The fingerprints cover the trainable parameters only (see
    :mod:`spark_estimators.core.checkpoint`): per-rank state such as BatchNorm running
    statistics may differ and never fails a fit.
    """
    fingerprints = [r["fingerprint"] for r in results]
    if len(set(fingerprints)) != 1:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(results):
            groups.setdefault(r["fingerprint"], []).append(int(r.get("rank", i)))
        ranks = "; ".join(f"ranks {g}" for g in groups.values())
        raise TrainingFailedError(
            f"ranks ended with different weights ({len(groups)} distinct: {ranks}): the "
            "trainable parameters diverged, so some rank updated them outside the "
            "DistributedOptimizer (a skipped or extra optimizer step, weights changed in "
            "place, a callback that edits weights on one rank). Running statistics "
            "(BatchNorm) are not compared; if no such code is yours, please report it"
        )
    return fingerprints
