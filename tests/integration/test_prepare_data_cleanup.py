"""A failed prepare_data leaves nothing of itself in the store (issue 40).

Before, bad data found during the write left the dataset's (emptied) directories behind, and a
failed write job left its directories and the files of the tasks that had finished.
"""

from __future__ import annotations

import os

import pytest

from spark_estimators.data import prepare_data
from spark_estimators.errors import ConfigurationError, StoreError
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


def tree(root) -> list[str]:
    """Every file and directory under ``root``, relative to it."""
    found = []
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, n)) for n in dirs + files]
    return sorted(found)


def test_nulls_found_during_the_write_leave_nothing_behind(spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    store = LocalStore(str(tmp_path / "store"))
    store.check_writable()  # creates the store's directory
    # Past the rows the shape sample reads: found by the write job itself.
    nulls = [i for i in range(40, 80) if i % 7 == 0]
    rows = [(None if i in nulls else Vectors.dense([float(i), 1.0]), float(i)) for i in range(80)]
    df = spark.createDataFrame(rows, ["features", "y"])
    before = tree(tmp_path)
    with pytest.raises(
        ConfigurationError, match=rf"null or NaN .* column\(s\) 'features': {len(nulls)} "
    ):
        prepare_data(2, store, df, ["features"], ["y"], validation=0.25)
    assert tree(tmp_path) == before
    assert store.list_datasets() == []

    meta = prepare_data(2, store, df.na.drop(), ["features"], ["y"], validation=0.25)
    assert meta.train_rows + meta.val_rows == 80 - len(nulls)
    assert store.list_datasets() == [meta.dataset_idx]


def test_a_failed_write_removes_what_it_wrote(spark, tmp_path):
    """The validation directory cannot be created (its parent is a file): the job fails."""
    blocker = tmp_path / "elsewhere"
    blocker.write_text("a file where a directory should be")
    store = LocalStore(str(tmp_path / "store"), val_path=str(blocker / "val"))
    store.check_writable()
    df = spark.range(40).selectExpr("cast(id as double) as x", "cast(id % 3 as double) as y")
    before = tree(tmp_path)
    with pytest.raises(StoreError, match="cannot write the prepared data"):
        prepare_data(2, store, df, ["x"], ["y"], validation=0.25)
    assert tree(tmp_path) == before, "the failed preparation left its training directory"

    blocker.unlink()
    blocker.mkdir()
    meta = prepare_data(2, store, df, ["x"], ["y"], validation=0.25)
    assert meta.train_rows + meta.val_rows == 40
    assert store.list_datasets() == [meta.dataset_idx]
