"""Vectorised Arrow conversions: Spark vector structs, compact sparse form, validity checks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from spark_estimators.data._arrow import (
    column_to_numpy,
    compact_parts,
    invalid_rows,
    vector_udt_parts,
    vector_udt_sizes,
)
from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.errors import StoreError

UDT = pa.struct(
    [
        ("type", pa.int8()),
        ("size", pa.int32()),
        ("indices", pa.list_(pa.int32())),
        ("values", pa.list_(pa.float64())),
    ]
)


def spark_vectors(rows):
    """Spark's VectorUDT layout: dense rows are (1, None, None, values)."""
    out = []
    for row in rows:
        if row is None:
            out.append(None)
        elif isinstance(row, dict):
            out.append({"type": 0, "size": row["size"], "indices": row["i"], "values": row["v"]})
        else:
            out.append({"type": 1, "size": None, "indices": None, "values": row})
    return pa.array(out, UDT)


def test_mixed_dense_and_sparse_vectors_densify():
    arr = spark_vectors([[1.0, 2.0, 3.0, 4.0], {"size": 4, "i": [3], "v": [7.0]}, [0, 0, 5.0, 0]])
    dense = vector_udt_parts(arr).to_dense(4)
    np.testing.assert_array_equal(dense, [[1, 2, 3, 4], [0, 0, 0, 7], [0, 0, 5, 0]])
    np.testing.assert_array_equal(vector_udt_sizes(arr), [4, 4, 4])


def test_compact_form_round_trips_and_respects_slices():
    arr = spark_vectors(
        [{"size": 5, "i": [0, 4], "v": [1.0, 2.0]}, [1.0] * 5, {"size": 5, "i": [], "v": []}]
    )
    compact = vector_udt_parts(arr.slice(1, 2)).to_arrow()
    assert [f.name for f in compact.type] == ["indices", "values"]
    info = ColumnInfo("v", "sparse_vector", "float64", (5,))
    np.testing.assert_array_equal(column_to_numpy(compact, info), [[1] * 5, [0] * 5])
    parts = compact_parts(compact)
    assert parts.lengths.tolist() == [5, 0]


def test_fixed_lists_become_2d_views_and_bad_lengths_are_named():
    info = ColumnInfo("a", "array", "float32", (2,))
    arr = pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.float32())).slice(1)
    out = column_to_numpy(arr, info)
    assert out.shape == (2, 2) and out.flags.writeable
    np.testing.assert_array_equal(out, [[3, 4], [5, 6]])
    with pytest.raises(StoreError, match=r"column 'a': expected 2 values.*row with 3"):
        column_to_numpy(pa.array([[1, 2], [1, 2, 3]], pa.list_(pa.float32())), info)


def test_invalid_rows_finds_nulls_nans_and_wrong_lengths():
    scalar = ColumnInfo("x", "scalar", "float64", ())
    invalid, bad = invalid_rows(pa.array([1.0, None, float("nan"), 2.0]), scalar)
    assert invalid.tolist() == [False, True, True, False] and not bad.any()

    lists = ColumnInfo("a", "array", "float64", (2,))
    arr = pa.array([[1.0, 2.0], [1.0, float("nan")], None, [1.0], [3.0, None]])
    invalid, bad = invalid_rows(arr, lists)
    assert invalid.tolist() == [False, True, True, False, True]
    assert bad.tolist() == [False, False, False, True, False]

    vectors = ColumnInfo("v", "sparse_vector", "float64", (3,))
    arr = spark_vectors(
        [[1.0, 2.0, 3.0], {"size": 4, "i": [0], "v": [1.0]}, None, [float("nan")] * 3]
    )
    invalid, bad = invalid_rows(arr, vectors)
    assert invalid.tolist() == [False, False, True, True]
    assert bad.tolist() == [False, True, False, False]
