"""Column arrays to model inputs, and model outputs to Arrow.

Training (on the ranks) and inference (in ``transform``) use the same functions, so both see
identical tensors.

Conventions (documented for users in docs/concepts.md):

- A feature column becomes one model input, ``model(*inputs)`` in ``feature_cols`` order.
  Float columns become float32, integer columns stay int64 (embedding indices).
  A scalar column is ``[batch, 1]``, an array/vector column ``[batch, n]``; ``input_shapes``
  reshape them, Horovod-style with the batch as ``-1`` (``[[-1, 1, 28, 28]]`` for images);
  a shape without the leading ``-1`` is read as a per-row shape.
- A label column is ``[batch]`` for scalars and ``[batch, n]`` for arrays (``label_shapes``
  reshapes them); as in Horovod, a label with as many values as the model's output is reshaped
  to the output's shape before the loss, so ``[batch, 1]`` outputs and scalar labels match.
  Integer labels stay int64.
- Class indices (``index_cols``): a column the model needs as integer class indices (a
  ``StringIndexer`` label for ``CrossEntropyLoss``, an index column that feeds an
  ``nn.Embedding``) becomes int64 even when it is floating; its values must be whole numbers.
  Which columns those are is decided in the driver (:mod:`spark_estimators.torch.indices`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import DataType


def as_model_array(values: np.ndarray) -> np.ndarray:
    """Cast for a model: float to float32, integers and bools to int64."""
    if values.dtype.kind == "f":
        return values.astype(np.float32, copy=False)
    if values.dtype.kind in "iub":
        return values.astype(np.int64, copy=False)
    raise TypeError(f"cannot feed a column of dtype {values.dtype} to a model")


def as_index_array(values: np.ndarray, col: str) -> np.ndarray:
    """Cast class indices to int64; floating values must be whole numbers (0.0, 1.0, ...).

    Raises ValueError naming ``col`` for a fractional or NaN value (the driver checks the data
    before training, so this guards data changed behind its back).
    """
    if values.dtype.kind == "f":
        fractional = values != np.floor(values)  # NaN and inf too
        if fractional.any():
            raise ValueError(
                f"column {col!r} is used as integer class indices but holds "
                f"{values[fractional].reshape(-1)[0]!r}, which is not a whole number"
            )
        return values.astype(np.int64)
    return as_model_array(values)


def for_torch(values: np.ndarray) -> np.ndarray:
    """C-contiguous and writable, ready for ``torch.from_numpy``.

    Batches read from Arrow are read-only views; ``torch.from_numpy`` of one warns (a
    UserWarning in every rank's and every transform worker's output) because a model that
    writes into its input would write into Arrow's buffers. Those are copied, others are not.
    """
    return np.require(values, requirements=("C", "W"))


def shape_column(
    values: np.ndarray, shape: Sequence[int] | None, scalar_as_column: bool = True
) -> np.ndarray:
    """Give one column's batch its shape.

    ``shape`` follows Horovod: a full shape whose first entry is ``-1`` (the batch), e.g.
    ``[-1, 1, 28, 28]``; a shape that does not start with ``-1`` is a per-row shape. Without a
    shape, scalar columns become ``[n, 1]`` (``scalar_as_column``) or stay ``[n]``.
    """
    n = values.shape[0]
    if shape is None:
        return values.reshape(n, 1) if values.ndim == 1 and scalar_as_column else values
    dims = [int(d) for d in shape]
    if dims and dims[0] == -1:
        return values.reshape(dims)
    return values.reshape((n, *dims))


def check_shapes(
    param: str,
    cols: Sequence[str],
    shapes: Sequence[Sequence[int] | None] | None,
    row_sizes: dict[str, int],
) -> None:
    """Raise ConfigurationError when a shape in ``shapes`` cannot hold its column's rows.

    ``row_sizes`` gives the values per row of each column (1 for scalars), from the data's
    description; the rule is :func:`shape_column`'s, so what passes here reshapes on the ranks
    and in ``transform`` alike.
    """
    from spark_estimators.errors import ConfigurationError

    if shapes is None:
        return
    for col, shape in zip(cols, shapes, strict=False):
        if shape is None or col not in row_sizes:
            continue
        dims = [int(d) for d in shape]
        per_row = dims[1:] if dims and dims[0] == -1 else dims
        n = row_sizes[col]
        known = int(np.prod([d for d in per_row if d != -1], dtype=np.int64))
        free = sum(d == -1 for d in per_row)
        if free > 1 or any(d == 0 or d < -1 for d in per_row):
            ok = False
        elif free == 1:
            ok = known > 0 and n % known == 0
        else:
            ok = known == n
        if not ok:
            raise ConfigurationError(
                f"{param} gives column {col!r} the shape {list(shape)!r}, but its rows hold {n} "
                f"value(s) each, which that shape cannot hold; use a shape whose per-row part "
                f"multiplies to {n}, e.g. {[-1, n]!r} (the leading -1 is the batch)"
            )


def model_inputs(
    arrays: dict[str, np.ndarray],
    cols: Sequence[str],
    shapes: Sequence[Sequence[int] | None] | None,
    scalar_as_column: bool = True,
    index_cols: Collection[str] = (),
) -> list[np.ndarray]:
    """The model's input arrays for ``cols``, each shaped by its entry of ``shapes``.

    Columns in ``index_cols`` become int64 class indices (:func:`as_index_array`).
    """
    out = []
    for i, col in enumerate(cols):
        shape = None if shapes is None else shapes[i]
        values = np.asarray(arrays[col])
        cast = as_index_array(values, col) if col in index_cols else as_model_array(values)
        out.append(shape_column(cast, shape, scalar_as_column))
    return out


def arrow_to_numpy(column: pa.Array | pa.ChunkedArray, name: str | None = None) -> np.ndarray:
    """An Arrow column (scalars or fixed-length lists of numbers) as a numpy array.

    ``name``: the feature column's, for the errors (null rows, rows of different lengths).
    """
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    named = f": column {name!r}" if name else ""
    if (
        pa.types.is_list(column.type)
        or pa.types.is_large_list(column.type)
        or (pa.types.is_fixed_size_list(column.type))
    ):
        n = len(column)
        if column.null_count:
            fix = f" (df.na.drop(subset=[{name!r}]))" if name else ""
            raise ValueError(
                "a feature column has null rows; drop or fill them before transform"
                f"{named} has {column.null_count} null row(s) in this batch{fix}"
            )
        flat = column.flatten().to_numpy(zero_copy_only=False)
        if n == 0:
            return flat.reshape(0, 0)
        if flat.size % n:
            raise ValueError(f"a feature column has rows of different lengths{named}")
        return flat.reshape(n, flat.size // n)
    return column.to_numpy(zero_copy_only=False)


def output_type(row_shape: Sequence[int]) -> DataType:
    """Spark type of an output column for a per-row shape: double, array, nested arrays."""
    from pyspark.sql.types import ArrayType, DoubleType

    t: DataType = DoubleType()
    for _ in row_shape:
        t = ArrayType(t, containsNull=False)
    return t


def numpy_to_arrow(values: np.ndarray) -> pa.Array:
    """[n, *row_shape] float array -> Arrow double / list<double> / list<list<double>>."""
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=np.float64)
    arr: pa.Array = pa.array(values.reshape(-1))
    for dim in reversed(values.shape[1:]):
        count = len(arr) // dim if dim else 0
        offsets = pa.array(
            np.arange(0, count * dim + 1, dim, dtype=np.int32)
            if dim
            else np.zeros(count + 1, dtype=np.int32)
        )
        arr = pa.ListArray.from_arrays(offsets, arr)
    return arr


def output_row_shape(output: np.ndarray) -> tuple[int, ...]:
    """Per-row shape of a model output; ``[n, 1]`` counts as a scalar per row."""
    shape = tuple(int(d) for d in output.shape[1:])
    return () if shape in ((), (1,)) else shape
