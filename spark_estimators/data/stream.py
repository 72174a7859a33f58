"""``data="stream"``, driver side: the DataFrame the training stage itself consumes.

With ``data="stream"`` an estimator writes no Parquet copy. The barrier stage that runs the ranks
maps over the user's DataFrame instead of a dummy one: :func:`prepare_stream` selects the used
columns (ML vectors become ``array<float>`` in the JVM with ``vector_to_array``, as
``prepare_data`` does), adds the validation flag (a fraction splits with ``rand(seed)``, exactly as
``prepare_data``; a column marks rows that are true or > 0) and repartitions to ``num_proc`` (a
round-robin shuffle: equal shares, one partition per rank), unless the DataFrame already has
``num_proc`` partitions and no shuffle in its plan (:func:`keeps_partitions`): then each rank
streams one of them as it is, with no shuffle (ranks with fewer rows wrap around, as always).
Each task writes its partition to a rank-local Arrow spill that its rank reads while it grows
(:mod:`spark_estimators.task.stream_spill`, :mod:`spark_estimators.data.stream_reader`).

Checks that need no job run here: columns exist and have supported types; shapes come from the
schema (``ml_attr``) or from a few rows, as ``prepare_data`` does. Nulls, NaNs and wrong lengths
are only seen in the rows: each rank checks its rows as it first reads them
(:func:`~spark_estimators.data.stream_reader.check_rows`) and the fit fails naming the column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_estimators.data._writer import PartitionWriter
    from spark_estimators.data.stream_copy import StreamCopy

from spark_estimators.data.metadata import SPLITS, ColumnInfo, ParquetFileInfo
from spark_estimators.errors import ConfigurationError

#: Values of the estimators' ``data`` Param: a prepared copy, the stream, or the stream that
#: also writes the copy (:mod:`spark_estimators.data.stream_copy`).
DATA_MODES = ("parquet", "stream", "parquet+stream")
#: The modes whose ranks read the stream.
STREAM_MODES = ("stream", "parquet+stream")


@dataclass
class StreamMetadata:
    """What the ranks and the driver know of streamed data: columns, roles, a validation split.

    It stands where a prepared dataset's :class:`~spark_estimators.data.DatasetMetadata` does;
    there are no files and the row counts are only known to the ranks once their tasks have read
    the DataFrame.
    """

    columns: dict[str, ColumnInfo]
    feature_cols: list[str]
    label_cols: list[str]
    sample_weight_col: str | None
    has_val: bool
    dataset_idx: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    streamed: bool = True
    #: The driver's :class:`StreamInput` (never pickled: the ranks get the metadata only).
    source: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["source"] = None
        return state

    def files(self, split: str = "train") -> list[ParquetFileInfo]:
        """No files: streamed data lives only in the ranks' spills."""
        if split not in SPLITS:
            raise ConfigurationError(f"split {split!r} is not one of {SPLITS!r}")
        return []

    def peek(self, columns: Sequence[str], rows: int) -> dict[str, Any]:
        """The first ``rows`` rows of ``columns`` as the ranks decode them (driver; one job).

        Used for MLflow's example inputs: the DataFrame's first rows, vectors as arrays.
        """
        from spark_estimators.data._arrow import table_to_numpy

        if self.source is None:
            raise ConfigurationError("peek() needs the driver's StreamMetadata of a fit")
        frame = self.source.dataframe.select(*columns).limit(rows)
        to_arrow = getattr(frame, "toArrow", None)
        if to_arrow is not None:
            table = to_arrow()
        else:  # pyspark 3.5
            import pyarrow as pa

            table = pa.Table.from_pandas(frame.toPandas(), preserve_index=False)
        return table_to_numpy(table, {c: self.columns[c] for c in columns})

    @property
    def train_rows(self) -> int:
        """0: the driver never counts streamed rows (only the ranks learn their counts)."""
        return 0

    @property
    def val_rows(self) -> int:
        """0: see :attr:`train_rows`."""
        return 0

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-row shape of every column."""
        return {name: col.shape for name, col in self.columns.items()}


@dataclass(frozen=True)
class StreamInput:
    """The DataFrame the training stage maps over (driver only) and its validation flag column.

    ``kept_partitions``: the DataFrame's own partitions, one per rank (no round-robin);
    ``copy_target``: with ``data="parquet+stream"``, the Parquet copy its tasks write.
    """

    dataframe: DataFrame
    split_col: str | None
    kept_partitions: bool = False
    copy_target: StreamCopy | None = None

    @property
    def copy(self) -> PartitionWriter | None:
        """The tasks' Parquet writer (``data="parquet+stream"``), else None."""
        return None if self.copy_target is None else self.copy_target.writer

    def finished(self, reports: list[str]) -> None:
        """Every rank and task succeeded: publish the copy the tasks wrote, if any."""
        if self.copy_target is not None:
            self.copy_target.publish(reports)


def prepare_stream(
    num_proc: int,
    df: DataFrame,
    feature_cols: Sequence[str] | str,
    label_cols: Sequence[str] | str | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    *,
    seed: int = 42,
    check_columns: Callable[[dict[str, ColumnInfo]], None] | None = None,
) -> tuple[StreamInput, StreamMetadata]:
    """The training stage's input for ``df`` and its description (no job unless shapes need one).

    Parameters
    ----------
    num_proc
        Number of ranks: the DataFrame is repartitioned to exactly this many partitions.
    df
        The Spark DataFrame (classic or Spark Connect).
    feature_cols, label_cols, validation, sample_weight_col
        As :func:`~spark_estimators.data.prepare_data`; a validation fraction splits the same rows
        as ``prepare_data`` with the same ``seed``.
    seed
        Seed of the random validation split.
    check_columns
        Called with the columns' descriptions before anything runs (``input_shapes`` checks).

    Returns
    -------
    tuple
        ``(StreamInput, StreamMetadata)``.
    """
    from spark_estimators._base.session import ensure_driver_side
    from spark_estimators.data.columns import (
        SPLIT_COL,
        check_args,
        describe_columns,
        kind_of,
        training_frame,
    )
    from spark_estimators.store.base import StoreBase

    ensure_driver_side("prepare_stream")

    features, labels, validation_col, fraction = check_args(
        num_proc,
        StoreBase.__new__(StoreBase),  # check_args wants a store; streaming writes none
        df,
        feature_cols,
        label_cols,
        validation,
        sample_weight_col,
        None,
    )
    used = features + labels + ([sample_weight_col] if sample_weight_col else [])
    kinds = {name: kind_of(df, name) for name in used}
    columns = describe_columns(df, used, kinds, False, check_columns)
    partitions = None if keeps_partitions(df, num_proc) else num_proc
    frame, has_split = training_frame(df, columns, validation_col, fraction, seed, partitions)
    meta = StreamMetadata(
        columns={c.name: c for c in columns},
        feature_cols=features,
        label_cols=labels,
        sample_weight_col=sample_weight_col,
        has_val=has_split,
        params={"validation": validation, "seed": seed if fraction else None},
    )
    source = StreamInput(frame, SPLIT_COL if has_split else None, partitions is None)
    return source, meta


def keeps_partitions(df: DataFrame, num_proc: int) -> bool:
    """True when ``df`` already has ``num_proc`` partitions and no shuffle decides their count.

    Then each rank streams one of them as it is and the stage skips the round-robin
    repartition, a full shuffle of the rows (about 10 of 16 s of a 1M x 32 stream fit's Spark
    side here). Only a classic session's plan without an ``Exchange`` qualifies: a shuffle's
    partition count can change at run time (adaptive execution), which a barrier stage of
    ``num_proc`` ranks cannot follow; Spark Connect sessions always repartition.
    """
    from spark_estimators.data.columns import plain_partitions

    return plain_partitions(df) == num_proc


#: Params that only shape the Parquet copy, refused with data="stream" and "parquet+stream"
#: (not silently ignored; the latter writes the copy in the stream's layout, as is).
_PARQUET_ONLY = {
    "partitionsPerProcess": (None, "partitions_per_process"),
    "compressSparseCols": (False, "compress_sparse_cols"),
    "dropInvalidRows": (False, "drop_invalid_rows"),
    "inmemoryCacheAll": (False, "inmemory_cache_all"),
}


def check_data_mode(est: Any) -> None:
    """Driver-side checks of ``data`` and of the params it cannot be combined with."""
    mode = est.getOrDefault("data")
    if mode not in DATA_MODES:
        raise ConfigurationError(f"data={mode!r} is invalid: expected one of {DATA_MODES}")
    if mode not in STREAM_MODES:
        return
    fix = "Use data='parquet' (the default) for it"
    why = (
        "no Parquet copy is written; each rank spills its rows to local disk"
        if mode == "stream"
        else "the copy is written as the rows stream to the ranks, one partition per rank"
    )
    for name, (unset, keyword) in _PARQUET_ONLY.items():
        if est.hasParam(name) and est.getOrDefault(name) != unset:
            raise ConfigurationError(
                f"{keyword}={est.getOrDefault(name)!r} has no effect with data={mode!r} ({why})."
                f" {fix}, or leave {keyword} at {unset!r}"
            )
    if est.getOrDefault("reader") != "arrow":
        raise ConfigurationError(
            f"reader={est.getOrDefault('reader')!r} reads Parquet; data={mode!r} has its own "
            f"reader. {fix}, or leave reader='arrow'"
        )
    backend = est.getOrDefault("backend")
    from spark_estimators.core.backend import SparkBackend

    if backend is not None and not isinstance(backend, SparkBackend):
        raise ConfigurationError(
            f"backend={type(backend).__name__} cannot stream: data={mode!r} needs the Spark "
            f"barrier stage of SparkBackend to read the DataFrame. {fix}"
        )
    if mode == "parquet+stream" and est.getElastic():
        raise ConfigurationError(
            "elastic=True relaunches failed attempts from checkpoints, but data='parquet+stream' "
            "writes its Parquet copy during one attempt and cannot resume it. Use "
            "data='parquet' with elastic=True (the copy is written before training), or "
            "elastic=False"
        )
    if mode == "stream" and est.getOrDefault("store") is None:
        for keyword, value in (
            ("run_id", est.getOrDefault("runId")),
            ("elastic", est.getElastic()),
        ):
            if value:
                raise ConfigurationError(
                    f"{keyword}={value!r} resumes from checkpoints, which need a store: with "
                    "data='stream' and no store= nothing is kept between fits or relaunches. "
                    "Pass store=Store.create('/shared/path') (checkpoints and logs go there; the "
                    "data still streams), or drop it"
                )
