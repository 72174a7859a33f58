"""horovod's ``horovod.spark.common.util.prepare_data`` spelling, over :func:`prepare_data`.

Code written for horovod calls ``util.prepare_data(num_processes=..., store=..., df=...,
label_columns=..., feature_columns=...)`` as a context manager that yields the dataset index.
Importing this module as ``util`` (``from spark_estimators.data import horovod_util as util``)
lets that code run unchanged; new code should call :func:`spark_estimators.data.prepare_data`,
whose keywords are the estimators' (``num_proc``, ``feature_cols``, ``label_cols``) and which
returns the dataset's metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from spark_estimators.data.prepare import prepare_data as _prepare_data
from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_estimators.store.base import StoreBase


@contextlib.contextmanager
def prepare_data(
    num_processes: int,
    store: StoreBase,
    df: DataFrame,
    label_columns: Sequence[str] | None = None,
    feature_columns: Sequence[str] | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    partitions_per_process: int | None = None,
    verbose: int = 0,
) -> Iterator[str | None]:
    """Prepare ``df`` in ``store`` as horovod's ``util.prepare_data`` did; yields the dataset index.

    Parameters
    ----------
    num_processes
        Number of training processes (``num_proc``).
    store
        The :class:`~spark_estimators.store.Store` to write into.
    df
        The Spark DataFrame.
    label_columns
        Label columns (required, as in horovod).
    feature_columns
        Feature columns; None means every column that is not a label, as in horovod.
    validation, sample_weight_col, compress_sparse, verbose
        As in :func:`spark_estimators.data.prepare_data`.
    partitions_per_process
        Files per process; None (the default here, horovod's was 10) chooses from the data's size.

    Yields
    ------
    str or None
        The dataset index: ``estimator.fit_on_parquet(dataset_idx=idx)`` trains on it, and
        ``fit_on_parquet()`` without it trains on the most recently prepared dataset.

    Examples
    --------
    >>> from spark_estimators.data import horovod_util as util  # doctest: +SKIP
    >>> with util.prepare_data(4, store, df, label_columns=["y"]) as idx:  # doctest: +SKIP
    ...     model = estimator.fit_on_parquet(dataset_idx=idx)
    """
    if not label_columns:
        raise ConfigurationError(
            "prepare_data needs label_columns (a non-empty list of column names), as horovod's did"
        )
    labels = [label_columns] if isinstance(label_columns, str) else list(label_columns)
    if feature_columns is None:
        features = [c for c in df.columns if c not in set(labels)]
    elif isinstance(feature_columns, str):
        features = [feature_columns]
    else:
        features = list(feature_columns)
    with _prepare_data(
        num_processes,
        store,
        df,
        feature_cols=features,
        label_cols=labels,
        validation=validation,
        sample_weight_col=sample_weight_col,
        compress_sparse=compress_sparse,
        partitions_per_process=partitions_per_process,
        verbose=verbose,
    ) as meta:
        yield meta.dataset_idx


__all__ = ["prepare_data"]
