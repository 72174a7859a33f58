"""The columns ``prepare_data`` is given: argument checks, supported kinds, shapes.

Everything here runs in the driver before the write job: a bad argument, a missing or
unsupported column, or a shape that cannot be inferred fails in milliseconds with a
:class:`~spark_estimators.errors.ConfigurationError` that names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.errors import ConfigurationError
from spark_estimators.store.base import StoreBase

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType

#: Rows read to infer shapes when the schema does not give them.
SAMPLE_ROWS = 32
#: The boolean column that marks validation rows in the DataFrame handed to the writers/ranks.
#: A name of ours: a DataFrame that has a column by this name is refused (:func:`check_args`).
SPLIT_COL = "__spark_estimators_is_val__"
#: The dtype a dense ML vector column is stored (and streamed) as: ``vector_to_array``'s
#: float32. Every framework's converter feeds models float32 (:mod:`spark_estimators.core.tensors`)
#: and rounds a double the same way, so the training data is the same bits as from float64, at
#: half the bytes to write, read and decode (issue 45: the reader's CPU per step). Sparse vectors
#: (``compress_sparse``) and ``VectorUDT`` columns of a user's Parquet stay float64.
VECTOR_DTYPE = "float32"
#: The error for a DataFrame without rows.
EMPTY_MESSAGE = "the DataFrame is empty (0 rows); check the filters that produced it"

#: Spark's scalar types and the numpy dtype each is stored as.
SCALAR_DTYPES = {
    "boolean": "bool",
    "tinyint": "int8",
    "smallint": "int16",
    "int": "int32",
    "bigint": "int64",
    "float": "float32",
    "double": "float64",
}


def _as_list(value: Sequence[str] | str | None, what: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigurationError(f"{what} must be column names (strings), got {item!r}")
    return items


def check_args(
    num_proc: object,
    store: StoreBase,
    df: DataFrame,
    feature_cols: Sequence[str] | str | None,
    label_cols: Sequence[str] | str | None,
    validation: object,
    sample_weight_col: object,
    partitions_per_process: object,
) -> tuple[list[str], list[str], str | None, float]:
    """Check ``prepare_data``'s arguments in the driver, or raise a ConfigurationError.

    Returns the feature and label columns, the validation column (or None) and the validation
    fraction (0.0 without one).
    """
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ConfigurationError(f"num_proc={num_proc!r} must be a positive integer")
    if partitions_per_process is not None and (
        isinstance(partitions_per_process, bool)
        or not isinstance(partitions_per_process, int)
        or partitions_per_process < 1
    ):
        raise ConfigurationError(
            f"partitions_per_process={partitions_per_process!r} must be a positive integer or None"
        )
    if not isinstance(store, StoreBase):
        raise ConfigurationError(
            f"store={store!r} is not a Store; build one with Store.create('/path/or/url')"
        )
    if not hasattr(df, "schema") or not hasattr(df, "mapInArrow"):
        raise ConfigurationError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    features = _as_list(feature_cols, "feature_cols")
    labels = _as_list(label_cols, "label_cols")
    if not features:
        raise ConfigurationError("feature_cols is empty: name at least one feature column")
    if sample_weight_col is not None and not isinstance(sample_weight_col, str):
        raise ConfigurationError(f"sample_weight_col={sample_weight_col!r} must be a column name")
    used = features + labels + ([sample_weight_col] if sample_weight_col else [])
    dupes = sorted({c for c in used if used.count(c) > 1})
    if dupes:
        raise ConfigurationError(
            f"columns {dupes!r} are named more than once in the feature, "
            "label and sample weight columns"
        )
    validation_col: str | None = None
    fraction = 0.0
    if isinstance(validation, str):
        validation_col = validation
        if validation in used:
            raise ConfigurationError(
                f"validation column {validation!r} is also a feature/label/weight column"
            )
    elif validation is not None:
        if (
            isinstance(validation, bool)
            or not isinstance(validation, int | float)
            or not (0.0 <= float(validation) < 1.0)
        ):
            raise ConfigurationError(
                f"validation={validation!r} must be a fraction in [0, 1) (e.g. 0.1) or the name "
                "of a bool/numeric column"
            )
        fraction = float(validation)
    names = list(df.columns)
    if SPLIT_COL in names:
        # Ours marks validation rows next to the user's columns: one of the same name would be
        # ambiguous (used) or silently look like a validation flag it is not (unused).
        raise ConfigurationError(
            f"the DataFrame has a column named {SPLIT_COL!r}, a name spark_estimators reserves "
            "for its own validation flag; rename or drop it first, e.g. "
            f"df.withColumnRenamed({SPLIT_COL!r}, 'is_val'), and pass validation='is_val' if it "
            "marks the validation rows"
        )
    wanted = used + ([validation_col] if validation_col else [])
    missing = [c for c in wanted if c not in names]
    if missing:
        raise ConfigurationError(
            f"column(s) {missing!r} not found in the DataFrame; available columns: {names!r}"
        )
    if validation_col is not None:
        kind = kind_of(df, validation_col, for_validation=True)
        assert kind == "scalar"
    return features, labels, validation_col, fraction


def kind_of(df: DataFrame, name: str, for_validation: bool = False) -> str:
    """The stored kind of a column from its Spark type, or a ConfigurationError saying why not."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import types as T

    dt = df.schema[name].dataType
    role = "validation column" if for_validation else "column"
    if isinstance(dt, T.StringType | T.CharType | T.VarcharType):
        raise ConfigurationError(
            f"{role} {name!r} is a string column ({dt.simpleString()}); index or encode it first, "
            f"e.g. StringIndexer(inputCol={name!r}, outputCol={name + '_idx'!r}) and then "
            "OneHotEncoder if the model needs one-hot input"
        )
    if dt.simpleString() in SCALAR_DTYPES:
        return "scalar"
    if not for_validation:
        if isinstance(dt, VectorUDT | OldVectorUDT):
            return "vector"
        if isinstance(dt, T.ArrayType) and dt.elementType.simpleString() in SCALAR_DTYPES:
            return "array"
    supported = (
        "bool or numeric"
        if for_validation
        else ("numbers, booleans, arrays of numbers, ML vectors")
    )
    decimal = isinstance(dt, T.DecimalType) or (
        isinstance(dt, T.ArrayType) and isinstance(dt.elementType, T.DecimalType)
    )
    hint = " (cast it to double)" if decimal else ""
    raise ConfigurationError(
        f"{role} {name!r} has unsupported type {dt.simpleString()!r}{hint}; supported: {supported}"
    )


def _scalar_column(name: str, dt: DataType) -> ColumnInfo:
    return ColumnInfo(name, "scalar", SCALAR_DTYPES[dt.simpleString()], (), dt.simpleString())


def columns_from_schema(
    df: DataFrame, used: list[str], kinds: dict[str, str], compress_sparse: bool
) -> list[ColumnInfo] | None:
    """The columns when the schema alone describes them, else None (then a sample is read).

    Scalars need no data; an ML vector column whose metadata gives its size (``ml_attr`` with
    ``num_attrs``, as VectorAssembler and most ML transformers write) needs none either unless
    ``compress_sparse`` asks whether its rows are mostly sparse. Array columns always need the
    sample. The write then checks every row's length against this size, as after a sample.
    """
    out = []
    for name in used:
        field = df.schema[name]
        dt = field.dataType
        if kinds[name] == "scalar":
            out.append(_scalar_column(name, dt))
            continue
        if kinds[name] != "vector" or compress_sparse:
            return None
        attrs = (field.metadata or {}).get("ml_attr") or {}
        size = attrs.get("num_attrs") if isinstance(attrs, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            return None
        out.append(ColumnInfo(name, "vector", VECTOR_DTYPE, (size,), dt.simpleString()))
    return out


def infer_columns(
    df: DataFrame, used: list[str], kinds: dict[str, str], compress_sparse: bool
) -> list[ColumnInfo]:
    """Shapes from the first rows (one small job), which also proves the DataFrame is not empty."""
    from pyspark.ml.linalg import SparseVector
    from pyspark.mllib.linalg import SparseVector as OldSparseVector
    from pyspark.sql.types import ArrayType

    rows = df.select(*used).limit(SAMPLE_ROWS).collect()
    if not rows:
        raise ConfigurationError(EMPTY_MESSAGE)
    out = []
    for name in used:
        dt = df.schema[name].dataType
        kind = kinds[name]
        if kind == "scalar":
            out.append(_scalar_column(name, dt))
            continue
        values = [r[name] for r in rows if r[name] is not None]
        sizes = [len(v) if kind == "array" else int(v.size) for v in values]
        if not sizes or sizes[0] == 0:
            found = "only nulls" if not sizes else "an empty value"
            raise ConfigurationError(
                f"cannot infer the shape of column {name!r}: its first {len(rows)} rows hold "
                f"{found}; drop or fill those rows, or give every row the same non-zero length"
            )
        if len(set(sizes)) > 1:
            raise ConfigurationError(
                f"column {name!r} has rows of different lengths ({sorted(set(sizes))!r} in the "
                "first rows); every row of an array or vector column must have the same length"
            )
        if kind == "array":
            assert isinstance(dt, ArrayType)
            dtype = SCALAR_DTYPES[dt.elementType.simpleString()]
        else:
            sparse = sum(isinstance(v, SparseVector | OldSparseVector) for v in values)
            if compress_sparse and sparse * 2 > len(values):
                kind = "sparse_vector"
            dtype = "float64" if kind == "sparse_vector" else VECTOR_DTYPE
        out.append(ColumnInfo(name, kind, dtype, (sizes[0],), dt.simpleString()))
    return out


def describe_columns(
    df: DataFrame,
    used: list[str],
    kinds: dict[str, str],
    compress_sparse: bool,
    check_columns: Callable[[dict[str, ColumnInfo]], None] | None = None,
) -> list[ColumnInfo]:
    """The used columns as stored: from the schema when it describes them, else from the first rows.

    Reading the schema needs no Spark job; only a column the schema cannot size (an ML vector
    without ``ml_attr`` metadata, an array) costs one small sample job. ``check_columns`` (the
    estimators' ``input_shapes`` check) sees the descriptions before anything is written or
    streamed.
    """
    columns = columns_from_schema(df, used, kinds, compress_sparse)
    if columns is None:
        columns = infer_columns(df, used, kinds, compress_sparse)
    if check_columns is not None:
        check_columns({c.name: c for c in columns})
    return columns


def plain_partitions(df: DataFrame) -> int | None:
    """``df``'s partition count when no shuffle decides it, else None.

    Only a classic session's plan without an ``Exchange`` qualifies: a shuffle's partition count
    can change at run time (adaptive execution), and its rows are the shuffle's; Spark Connect
    answers None. The rows of such partitions come in the same order each time they are computed
    (a file scan, a range, a cache), as a retried task needs.
    """
    jdf = getattr(df, "_jdf", None)
    if jdf is None:  # Spark Connect
        return None
    try:
        if "Exchange" in jdf.queryExecution().executedPlan().toString():
            return None
        return int(jdf.rdd().getNumPartitions())
    except Exception:  # planning failed here: repartition as usual, let the job report it
        return None


def training_frame(
    df: DataFrame,
    columns: Sequence[ColumnInfo],
    validation_col: str | None,
    fraction: float,
    seed: int,
    partitions: int | None,
    *,
    by_content: bool = False,
) -> tuple[DataFrame, bool]:
    """The used columns, the validation flag (:data:`SPLIT_COL`), ``partitions`` partitions.

    ``partitions=None`` keeps ``df``'s partitions (no shuffle). Else a round-robin
    ``repartition(partitions)`` (equal shares within a row: ``data="stream"`` gives each rank
    one partition), or with ``by_content`` a hash repartition on every used column
    (``xxhash64``), which ``prepare_data`` uses: its readers balance the ranks' rows
    themselves, and Spark sorts every partition before a round-robin shuffle (so that a retried
    task sends the same rows to the same place) but not before a hash shuffle, which is just as
    deterministic. That sort was ~0.8 of 2.7 s of a 1M x 32 write here (bench/RESULTS.md, issue
    26). Shares then differ by about the square root of the rows; identical rows land together.
    Vectors become ``array<float>`` (:data:`VECTOR_DTYPE`) after the shuffle. The flag is the
    validation column (> 0 or true; null is training) or ``rand(seed) < fraction``, so the
    Parquet path and ``data="stream"`` pick the same rows. Returns the frame and whether it has
    the flag.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    split = None
    if validation_col is not None:
        vtype = df.schema[validation_col].dataType.simpleString()
        flag = F.col(validation_col) if vtype == "boolean" else F.col(validation_col) > 0
        split = F.coalesce(flag, F.lit(False))
    elif fraction > 0:
        split = F.rand(seed) < F.lit(fraction)
    selected = [F.col(c.name) for c in columns]
    if split is not None:
        selected.append(split.alias(SPLIT_COL))
    shuffled = df.select(*selected)
    if partitions is not None and by_content:
        shuffled = shuffled.repartition(partitions, F.xxhash64(*shuffled.columns))
    elif partitions is not None:
        shuffled = shuffled.repartition(partitions)
    # A null vector stays null, for the writer (or the stream reader) to count and name:
    # vector_to_array itself fails the task on one, with an error that names no column.
    converted = [
        F.when(F.col(c.name).isNotNull(), vector_to_array(F.col(c.name), VECTOR_DTYPE)).alias(
            c.name
        )
        if c.kind == "vector"
        else F.col(c.name)
        for c in columns
    ]
    if split is not None:
        converted.append(F.col(SPLIT_COL))
    return shuffled.select(*converted), split is not None
