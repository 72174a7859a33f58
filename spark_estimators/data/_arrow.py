"""Vectorised Arrow <-> numpy conversions for every column kind (no per-row Python).

Used on executors by the Parquet writer (checks, sparse compaction) and by the readers (decoding
to numpy). See :mod:`spark_estimators.data.metadata` for the column kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa

# Spark's VectorUDT struct: type 0 = sparse, 1 = dense.
_SPARSE_TYPE = 0


def combined(column: pa.Array | pa.ChunkedArray) -> Any:
    """A single Arrow array from an Array or ChunkedArray."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def list_lengths(arr: Any) -> np.ndarray:
    """Length of each list (0 for null lists) as int64."""
    import pyarrow.compute as pc

    return np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(), dtype=np.int64)


def _writable(values: np.ndarray) -> np.ndarray:
    # Hand out arrays users may modify in place (x -= mean); see values_to_numpy.
    return values if values.flags.writeable else values.copy()


def values_to_numpy(arr: Any) -> np.ndarray:
    """A numeric Arrow array as numpy, writable and without a copy when Arrow allows it.

    pyarrow marks every numpy view read-only, but a mutable buffer (what Parquet decoding and
    ``combine_chunks`` allocate) belongs to the array alone, so a view of it may be changed in
    place; this saves the reader a copy of every decoded value. Other arrays (nulls, booleans,
    immutable buffers such as memory-mapped files) go through ``to_numpy``.
    """
    import pyarrow as pa

    kind = arr.type
    if not arr.null_count and (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        buf = arr.buffers()[1]
        if buf is not None and buf.is_mutable:
            dtype = np.dtype(kind.to_pandas_dtype())
            return np.frombuffer(
                buf, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize
            )
    return np.asarray(arr.to_numpy(zero_copy_only=False))


@dataclass
class SparseParts:
    """Rows of sparse vectors as flat (index, value) lists with per-row lengths."""

    lengths: np.ndarray  # int64 [rows]
    indices: np.ndarray  # int32 [nnz]
    values: np.ndarray  # float64 [nnz]

    def to_dense(self, size: int, dtype: str = "float64") -> np.ndarray:
        rows = len(self.lengths)
        out = np.zeros((rows, size), dtype=dtype)
        if len(self.values):
            row_of = np.repeat(np.arange(rows), self.lengths)
            out[row_of, self.indices] = self.values
        return out

    def to_arrow(self) -> Any:
        """``struct<indices: list<int32>, values: list<double>>`` (the compact stored form)."""
        import pyarrow as pa

        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=offsets[1:])
        return pa.StructArray.from_arrays(
            [
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(self.indices, pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(self.values, pa.float64())),
            ],
            names=["indices", "values"],
        )


def vector_udt_parts(column: pa.Array | pa.ChunkedArray) -> SparseParts:
    """Spark's raw vector struct (dense and sparse rows mixed) as sparse parts."""
    arr = combined(column)
    values = arr.field("values")
    lengths = list_lengths(values)
    flat_values = values.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    starts = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    flat_indices = (
        np.arange(len(flat_values), dtype=np.int64) - np.repeat(starts, lengths)
    ).astype(np.int32)
    types = arr.field("type").to_numpy(zero_copy_only=False)
    is_sparse = np.asarray(types == _SPARSE_TYPE)
    if is_sparse.any():
        sparse_idx = arr.field("indices").flatten().to_numpy(zero_copy_only=False)
        flat_indices[np.repeat(is_sparse, lengths)] = sparse_idx
    return SparseParts(lengths, flat_indices, flat_values)


def vector_udt_sizes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The size of each vector of Spark's raw struct (values length for dense rows)."""
    import pyarrow.compute as pc

    arr = combined(column)
    sizes = arr.field("size")
    dense_sizes = list_lengths(arr.field("values"))
    return np.where(
        np.asarray(pc.is_valid(sizes).to_numpy(zero_copy_only=False)),
        pc.fill_null(sizes, 0).to_numpy(zero_copy_only=False),
        dense_sizes,
    )


def compact_parts(column: pa.Array | pa.ChunkedArray) -> SparseParts:
    """Our compact ``struct<indices, values>`` as sparse parts."""
    arr = combined(column)
    values = arr.field("values")
    return SparseParts(
        lengths=list_lengths(values),
        indices=arr.field("indices").flatten().to_numpy(zero_copy_only=False),
        values=values.flatten().to_numpy(zero_copy_only=False),
    )


def fixed_list_to_numpy(
    column: pa.Array | pa.ChunkedArray, width: int, name: str = ""
) -> np.ndarray:
    """A list column whose rows all have ``width`` values, as a ``[rows, width]`` array."""
    arr = combined(column)
    flat = values_to_numpy(arr.flatten())
    if arr.null_count or len(flat) != len(arr) * width:
        lengths = list_lengths(arr)
        bad = np.flatnonzero(lengths != width)
        found = int(lengths[bad[0]]) if len(bad) else None
        raise StoreError(
            f"column {name!r}: expected {width} values in every row, found a row with "
            f"{found!r} ({len(bad)} bad rows, {arr.null_count} nulls); re-run prepare_data"
        )
    return flat.reshape(len(arr), width)


def column_to_numpy(
    column: pa.Array | pa.ChunkedArray, info: ColumnInfo, writable: bool = True
) -> np.ndarray:
    """Decode one Arrow column to numpy with the shape of ``info`` (rows first).

    ``writable=False`` allows read-only views of Arrow memory (no copy).
    """
    if info.kind == "scalar":
        out = values_to_numpy(combined(column))
    elif info.kind in ("array", "vector"):
        out = fixed_list_to_numpy(column, info.size, info.name).reshape((-1, *info.shape))
    elif info.kind == "sparse_vector":
        return compact_parts(column).to_dense(info.size, info.dtype)
    elif info.kind == "vector_udt":
        return vector_udt_parts(column).to_dense(info.size, info.dtype)
    else:
        raise StoreError(f"column {info.name!r} has unknown kind {info.kind!r}")
    if out.dtype != np.dtype(info.dtype):
        out = out.astype(info.dtype)
    return _writable(out) if writable else out


def table_to_numpy(
    table: Any, columns: dict[str, ColumnInfo], writable: bool = True
) -> dict[str, np.ndarray]:
    """Decode the named columns of an Arrow table (or record batch)."""
    return {
        name: column_to_numpy(table.column(name), info, writable) for name, info in columns.items()
    }


def _nan_mask(values: Any) -> np.ndarray | None:
    """Where a floating-point Arrow array holds NaN; None when it holds none (the common case)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_floating(values.type) or len(values) == 0:
        return None
    dense = values.fill_null(0) if values.null_count else values
    as_numpy = dense.to_numpy(zero_copy_only=False)
    # One pass without a temporary: the sum is finite unless a NaN (or an inf) is there.
    if np.isfinite(np.add.reduce(as_numpy, dtype=np.float64)):
        return None
    mask = np.asarray(pc.is_nan(dense).to_numpy(zero_copy_only=False), dtype=bool)
    return mask if mask.any() else None


def _null_mask(values: Any) -> np.ndarray | None:
    import pyarrow.compute as pc

    if not values.null_count:
        return None
    return np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)


def invalid_rows(
    column: pa.Array | pa.ChunkedArray, info: ColumnInfo
) -> tuple[np.ndarray, np.ndarray]:
    """Two boolean masks: rows that are null or hold a NaN, and rows of the wrong length.

    ``info`` describes the column as it reaches the writer (``sparse_vector`` columns arrive as
    Spark's raw vector struct).
    """
    arr = combined(column)
    rows = len(arr)
    invalid = np.zeros(rows, dtype=bool)
    nulls = _null_mask(arr)
    if nulls is not None:
        invalid |= nulls
    if info.kind == "scalar":
        nans = _nan_mask(arr)
        if nans is not None:
            invalid |= nans
        return invalid, np.zeros(rows, dtype=bool)
    values = arr.field("values") if info.kind == "sparse_vector" else arr
    lengths = list_lengths(values)
    flat = values.flatten()
    bad_value = _null_mask(flat)
    nans = _nan_mask(flat)
    if nans is not None:
        bad_value = nans if bad_value is None else bad_value | nans
    if bad_value is not None:
        row_of = np.repeat(np.arange(rows), lengths)
        invalid[np.unique(row_of[bad_value])] = True
    sizes = vector_udt_sizes(arr) if info.kind == "sparse_vector" else lengths
    bad_length = ~invalid & (sizes != info.size)
    return invalid, bad_length
