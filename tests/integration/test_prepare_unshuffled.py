"""prepare_data without a shuffle: a DataFrame whose partitions no Exchange decides (issue 45)."""

from __future__ import annotations

import pytest

from spark_estimators.data import make_batch_reader, prepare_data
from spark_estimators.data.prepare import unshuffled_partitions
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def rank_rows(store, meta, size):
    """The distinct ``id``s and their ``y`` values each of ``size`` ranks reads in one epoch.

    (Its last batch is filled up by wrapping around to the rank's first rows.)"""
    shares = []
    for rank in range(size):
        reader = make_batch_reader(
            store.to_remote(), meta, split="train", rank=rank, size=size, batch_size=64,
            shuffle=False, columns=["id", "y"],
        )  # fmt: skip
        ids, labels = [], []
        for batch in reader:
            ids += batch["id"].tolist()
            labels += batch["y"].tolist()
        assert len(ids) - len(set(ids)) < 64
        unique = dict(zip(ids, labels, strict=True))
        shares.append((list(unique), list(unique.values())))
    return shares


def test_sorted_partitions_reach_every_rank_without_a_shuffle(spark, tmp_path):
    """Two partitions, all 0s then all 1s: no shuffle, yet each rank gets both classes.

    Every row is written once, the ranks' shares are equal, each rank reads about half of each
    input partition, and the write ran one job (the baseline's repartition runs a shuffle too).
    """
    from pyspark.sql import functions as F

    df = spark.range(0, 20_000, numPartitions=2).select(
        "id", (F.col("id") >= 10_000).cast("double").alias("y")
    )
    assert unshuffled_partitions(df, 2, None) == 2
    store = LocalStore(str(tmp_path / "s"))
    sc = spark.sparkContext
    sc.setJobGroup("unshuffled", "prepare")
    try:
        meta = prepare_data(2, store, df, "id", "y")
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert len(sc.statusTracker().getJobIdsForGroup("unshuffled")) == 1
    assert meta.params["shuffled"] is False and meta.params["partitions"] == 2
    names = [f.path.rsplit("/", 1)[1] for f in meta.train_files]
    assert [n[:15] for n in names] == [
        "s000-part-00000",
        "s000-part-00001",
        "s001-part-00000",
        "s001-part-00001",
    ]
    assert [f.rows for f in meta.train_files] == [5000] * 4
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(meta.train_files[0].path).metadata.row_group(0)
    kinds = {chunk.column(i).path_in_schema: chunk.column(i) for i in range(chunk.num_columns)}
    assert kinds["id"].is_stats_set and kinds["id"].statistics.min >= 0  # integers keep theirs
    assert not kinds["y"].is_stats_set  # floats: no min/max (never read, ~7% of the write)
    assert kinds["y"].compression == "SNAPPY"
    shares = rank_rows(store, meta, 2)
    ids = [i for share, _ in shares for i in share]
    assert sorted(ids) == list(range(20_000))  # every row exactly once
    for share, labels in shares:
        assert len(share) == 10_000
        assert sum(labels) == 5000  # half of each input partition
    # Another num_proc gets its own layout (the slices mix rows for 2 ranks only).
    meta3 = prepare_data(3, store, df, "id", "y")
    assert meta3.dataset_idx != meta.dataset_idx
    for share, labels in rank_rows(store, meta3, 3):
        assert len(share) in (6666, 6667) and 3000 <= sum(labels) <= 3700


def test_the_shuffle_stays_where_it_is_needed(spark, tmp_path):
    """A plan with an Exchange, more partitions than the write makes, or another explicit count
    is repartitioned as before; a validation split keeps every row once either way."""
    df = spark.range(0, 1000, numPartitions=2).selectExpr("id", "cast(id % 2 as double) as y")
    assert unshuffled_partitions(df.repartition(2), 2, None) is None
    assert unshuffled_partitions(df.groupBy("y").count(), 2, None) is None
    assert unshuffled_partitions(spark.range(0, 1000, numPartitions=9), 2, None) is None
    assert unshuffled_partitions(df, 2, 1) is None
    assert unshuffled_partitions(df, 2, 2) == 2
    store = LocalStore(str(tmp_path / "s"))
    shuffled = prepare_data(2, store, df.repartition(2), "id", "y")
    assert shuffled.params["shuffled"] is True
    assert all(f.path.rsplit("/", 1)[1].startswith("part-") for f in shuffled.train_files)
    meta = prepare_data(2, store, df, "id", "y", validation=0.25)
    assert meta.params["shuffled"] is False
    train = {i for share, _ in rank_rows(store, meta, 2) for i in share}
    val = set()
    for rank in range(2):
        reader = make_batch_reader(
            store.to_remote(), meta, split="val", rank=rank, size=2, batch_size=64,
            shuffle=False, columns=["id"],
        )  # fmt: skip
        for batch in reader:
            val |= set(batch["id"].tolist())
    assert train.isdisjoint(val) and train | val == set(range(1000))
    assert meta.train_rows + meta.val_rows == 1000 and 150 <= meta.val_rows <= 350
