"""Readers inside Spark tasks: the store view and metadata travel by pickle, ranks stay in step."""

from __future__ import annotations

import pytest

from spark_estimators.data import make_batch_reader, prepare_data
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


def read_as_rank(view, meta, batch_size, epochs):
    """What one rank task does: read ``epochs`` epochs, report (rank, steps, ids per epoch)."""

    def task(rank, _rows):
        reader = make_batch_reader(view, meta, rank=rank, size=2, batch_size=batch_size, seed=11)
        ids = [[int(i) for batch in reader for i in batch["id"]] for _ in range(epochs)]
        yield rank, reader.steps_per_epoch, ids

    return task


def test_two_rank_tasks_read_every_row_with_equal_steps(spark, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    df = spark.range(203).selectExpr("id", "cast(id as float) as y")
    meta = prepare_data(2, store, df, ["id"], ["y"], partitions_per_process=3)
    task = read_as_rank(store.to_remote(), meta, batch_size=16, epochs=2)
    results = sorted(
        spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(task).collect()
    )
    assert [r[0] for r in results] == [0, 1]
    assert {r[1] for r in results} == {7}  # ceil(ceil(203 / 2) / 16)
    for epoch in range(2):
        seen = [i for _, _, ids in results for i in ids[epoch]]
        assert len(seen) == 2 * 7 * 16
        assert set(seen) == set(range(203))
        assert len(seen) - 203 < 2 * 16
    assert results[0][2][0] != results[0][2][1]  # each epoch reshuffles
