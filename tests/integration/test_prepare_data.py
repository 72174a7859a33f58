"""prepare_data on a real SparkSession: round trips, validation, cache, concurrency, bad data."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from spark_estimators.data import DatasetMetadata, make_batch_reader, prepare_data
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def read_all(store, meta, split="train", size=2, batch_size=4):
    """{id: row} of a split read by ``size`` ranks (no shuffle), plus the steps of each rank."""
    rows, steps = {}, []
    for rank in range(size):
        reader = make_batch_reader(
            store.to_remote(),
            meta,
            split=split,
            rank=rank,
            size=size,
            batch_size=batch_size,
            shuffle=False,
            columns=list(meta.columns),
        )
        steps.append(reader.steps_per_epoch)
        for batch in reader:
            for i, row_id in enumerate(batch["id"].tolist()):
                rows[row_id] = {k: v[i] for k, v in batch.items()}
    return rows, steps


def schema_of(ddl):
    """A StructType from 'name type, ...' where type 'vector' is the ML VectorUDT."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = []
    for part in ddl.split(","):
        name, typ = part.split()
        dt = VectorUDT() if typ == "vector" else T._parse_datatype_string(typ)
        fields.append(T.StructField(name, dt))
    return T.StructType(fields)


def mixed_df(spark, n=61):
    from pyspark.ml.linalg import Vectors

    data = []
    for i in range(n):
        sparse = Vectors.sparse(6, [i % 6], [float(i)]) if i % 5 else Vectors.dense([1.0 * i] * 6)
        data.append(
            (
                i,
                i / 3,
                float(i),
                i % 2 == 0,
                i * 7,
                [float(i), -float(i), 0.5],
                [float(i)] * 2,
                Vectors.dense([i, i + 1.0]),
                sparse,
            )
        )
    ddl = (
        "id bigint, x double, f float, flag boolean, n int, arr array<double>,"
        " arrf array<float>, dv vector, sv vector"
    )
    return spark.createDataFrame(data, schema_of(ddl)), data


@pytest.mark.parametrize("compress_sparse", [False, True])
def test_every_column_kind_round_trips(spark, store, compress_sparse):
    df, data = mixed_df(spark)
    features = ["id", "x", "flag", "n", "arr", "arrf", "dv", "sv"]
    meta = prepare_data(
        2, store, df, features, ["f"], compress_sparse=compress_sparse, partitions_per_process=2
    )
    assert meta.columns["sv"].kind == ("sparse_vector" if compress_sparse else "vector")
    assert meta.columns["dv"].kind == "vector" and meta.shapes["dv"] == (2,)
    assert meta.columns["arrf"].dtype == "float32" and meta.columns["n"].dtype == "int32"
    # dense vectors are stored as float32; compressed sparse ones keep float64 values
    assert meta.columns["dv"].dtype == "float32"
    assert meta.columns["sv"].dtype == ("float64" if compress_sparse else "float32")
    assert (meta.train_rows, meta.val_rows, len(meta.train_files)) == (61, 0, 4)
    rows, steps = read_all(store, meta)
    assert steps == [8, 8] and sorted(rows) == list(range(61))
    for i, x, f, flag, n, arr, arrf, dv, sv in data:
        got = rows[i]
        assert (got["x"], got["f"], bool(got["flag"]), got["n"]) == (x, f, flag, n)
        np.testing.assert_array_equal(got["arr"], arr)
        np.testing.assert_array_equal(got["arrf"], arrf)
        np.testing.assert_array_equal(got["dv"], dv.toArray())
        np.testing.assert_array_equal(got["sv"], sv.toArray())


def test_vectors_are_stored_as_float32_with_the_bits_the_model_gets_from_doubles(spark, store):
    """float32 on disk, and each value is the float32 rounding of the double, as the converter
    rounds doubles for every framework (core/tensors.py): the model sees the same bits."""
    import pyarrow.parquet as pq
    from pyspark.ml.linalg import Vectors

    from spark_estimators.core.tensors import model_inputs

    rng = np.random.default_rng(3)
    doubles = rng.standard_normal((40, 5)) * 10.0 ** rng.integers(-30, 30, (40, 5))
    df = spark.createDataFrame(
        [(i, Vectors.dense(row.tolist()), 1.0 / 3) for i, row in enumerate(doubles)],
        schema_of("id bigint, v vector, y double"),
    )
    meta = prepare_data(2, store, df, ["id", "v"], ["y"])
    stored = pq.read_schema(meta.train_files[0].path).field("v").type
    assert str(stored) == "list<element: float>", stored
    rows, _ = read_all(store, meta)
    assert sorted(rows) == list(range(40))
    for i, row in enumerate(doubles):
        got = rows[i]["v"]
        assert got.dtype == np.float32
        (want,) = model_inputs({"v": row[None, :]}, ["v"], None, False, ())
        assert want.dtype == np.float32
        assert got.tobytes() == want[0].tobytes(), i  # bit for bit
        assert not np.array_equal(got.astype(np.float64), row)  # the doubles were rounded


def test_float_validation_splits_every_row_once_with_a_seed(spark, store):
    df = spark.range(400).selectExpr("id", "cast(id as float) as y")
    meta = prepare_data(2, store, df, ["id"], ["y"], validation=0.25, seed=7)
    train, _ = read_all(store, meta)
    val, _ = read_all(store, meta, split="val")
    assert (meta.train_rows, meta.val_rows) == (len(train), len(val))
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(400))
    assert 60 < len(val) < 140
    other = prepare_data(2, store, df, ["id"], ["y"], validation=0.25, seed=8)
    assert other.dataset_idx != meta.dataset_idx
    assert set(read_all(store, other, split="val")[0]) != set(val)


@pytest.mark.parametrize(
    ("expr", "is_val"), [("id % 4 = 0", lambda i: i % 4 == 0), ("id % 3", lambda i: i % 3 > 0)]
)
def test_column_validation_uses_true_or_positive_rows_and_drops_the_column(
    spark, store, expr, is_val
):
    df = spark.range(90).selectExpr("id", "cast(id * 2 as double) as y", f"{expr} as v")
    meta = prepare_data(2, store, df, ["id"], ["y"], validation="v")
    val, _ = read_all(store, meta, split="val")
    assert sorted(val) == [i for i in range(90) if is_val(i)]
    assert meta.train_rows == 90 - len(val)
    assert "v" not in meta.columns
    import pyarrow.parquet as pq

    assert pq.read_schema(meta.val_files[0].path).names == ["id", "y"]


def file_mtimes(store, meta):
    paths = [f.path for f in meta.train_files + meta.val_files]
    paths.append(store.get_dataset_metadata_path(meta.dataset_idx))
    return {p: store.stat(p).mtime_ns for p in paths}


def test_equal_plan_hits_the_cache_and_writes_nothing(spark, store):
    def make():  # 8 partitions: more than the write makes, so it shuffles (num_proc is no key)
        return spark.range(300, numPartitions=8).selectExpr("id", "rand(3) as x", "id % 2 = 0 as y")

    first = prepare_data(2, store, make(), ["id", "x"], ["y"], validation=0.1)
    before = file_mtimes(store, first)
    listing = sorted(store.listdir(first.train_path))
    again = prepare_data(2, store, make(), ["id", "x"], ["y"], validation=0.1)
    assert again == first
    assert file_mtimes(store, again) == before
    assert sorted(store.listdir(first.train_path)) == listing
    assert store.list_datasets() == [first.dataset_idx]
    # Only the layout changes with num_proc: the same data serves 3 ranks.
    assert prepare_data(3, store, make(), ["id", "x"], ["y"], validation=0.1) == first

    changed = prepare_data(2, store, make().filter("id > 10"), ["id", "x"], ["y"], validation=0.1)
    assert changed.dataset_idx != first.dataset_idx and changed.train_rows + changed.val_rows == 289
    params = prepare_data(2, store, make(), ["id", "x"], ["y"], validation=0.2)
    assert params.dataset_idx not in (first.dataset_idx, changed.dataset_idx)
    assert sorted(store.list_datasets()) == sorted(
        {first.dataset_idx, changed.dataset_idx, params.dataset_idx}
    )
    assert file_mtimes(store, first) == before


def test_rewritten_source_files_are_not_served_stale(spark, store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "source"
    source.mkdir()
    pq.write_table(pa.table({"id": np.arange(50), "y": np.zeros(50)}), source / "data.parquet")
    first = prepare_data(1, store, spark.read.parquet(str(source)), ["id"], ["y"])
    pq.write_table(pa.table({"id": np.arange(80), "y": np.ones(80)}), source / "data.parquet")
    second = prepare_data(1, store, spark.read.parquet(str(source)), ["id"], ["y"])
    assert second.dataset_idx != first.dataset_idx
    assert (first.train_rows, second.train_rows) == (50, 80)


def test_a_new_reader_of_the_store_finds_the_dataset_by_index(spark, store):
    df = spark.range(40).selectExpr("id", "cast(id as double) * 1.5 as y")
    meta = prepare_data(2, store, df, ["id"], ["y"])
    fresh = LocalStore(store.prefix_path)
    loaded = DatasetMetadata.load(fresh, meta.dataset_idx)
    assert loaded == meta and DatasetMetadata.load(fresh) == meta
    with prepare_data(2, fresh, df, ["id"], ["y"]) as again:  # context manager, like horovod
        assert again == meta
    assert fresh.exists(meta.train_files[0].path)  # leaving the block keeps the data


def test_concurrent_preparations_do_not_collide(spark, store):
    frames = [
        spark.range(100 + 10 * k).selectExpr("id", "cast(id as double) as y") for k in range(2)
    ]
    jobs = [frames[0], frames[1], frames[0]]
    results, errors = [None] * 3, []

    def run(k):
        try:
            results[k] = prepare_data(2, store, jobs[k], ["id"], ["y"], partitions_per_process=1)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors
    assert results[0] == results[2] and results[0].dataset_idx != results[1].dataset_idx
    assert [r.train_rows for r in results] == [100, 110, 100]
    for meta in results[:2]:
        rows, _ = read_all(store, meta)
        assert sorted(rows) == list(range(meta.train_rows))
        assert len(store.listdir(meta.train_path)) == len(meta.train_files)


def test_uneven_rows_give_equal_batch_counts(spark, store):
    meta = prepare_data(
        2, store, spark.range(101).selectExpr("id", "cast(id as double) as y"), "id", "y"
    )
    rows, steps = read_all(store, meta, batch_size=8)
    assert steps == [7, 7] and sorted(rows) == list(range(101))


def test_sorted_rows_are_mixed_across_ranks_by_a_hash_shuffle_without_a_sort(spark, tmp_path):
    """A DataFrame sorted by label (all 0s, then all 1s) must not give a rank one class.

    The write hashes each row's content (no round-robin, so Spark adds no sort before the
    shuffle); the same rows land in the same files each time, as a retried task needs.
    """
    from spark_estimators.data.columns import training_frame

    df = spark.range(400, numPartitions=2).selectExpr("id", "cast(id >= 200 as double) as y")
    metas = [
        prepare_data(2, LocalStore(str(tmp_path / name)), df, "id", "y", partitions_per_process=2)
        for name in ("a", "b")
    ]
    assert [m.train_rows for m in metas] == [400, 400]
    shards = []
    for meta, name in zip(metas, ("a", "b"), strict=True):
        st = LocalStore(str(tmp_path / name))
        per_rank = []
        for rank in range(2):
            reader = make_batch_reader(
                st.to_remote(), meta, split="train", rank=rank, size=2, batch_size=50,
                shuffle=False, columns=["id", "y"],
            )  # fmt: skip
            ids, labels = [], []
            for batch in reader:
                ids += batch["id"].tolist()
                labels += batch["y"].tolist()
            assert len(ids) == 200  # equal shares whatever the files hold
            assert 60 <= sum(labels) <= 140, f"rank {rank} got {sum(labels):.0f} of 200 ones"
            per_rank.append(sorted(ids))
        shards.append(per_rank)
        assert sorted(per_rank[0] + per_rank[1]) == list(range(400))
    assert shards[0] == shards[1]  # deterministic placement
    columns = list(metas[0].columns.values())
    frame, _ = training_frame(df, columns, None, 0.0, 0, 4, by_content=True)
    plan = frame._jdf.queryExecution().executedPlan().toString()
    # Spark's sort before a shuffle is inside the exchange (not in the plan): it comes with
    # RoundRobinPartitioning only.
    assert "hashpartitioning(xxhash64(" in plan and "RoundRobinPartitioning" not in plan, plan


def test_nulls_and_nans_are_counted_by_column_or_dropped(spark, store):
    data = [
        (i, None if i % 10 == 0 else float(i), [float(i), float("nan") if i == 3 else 1.0])
        for i in range(40)
    ]
    df = spark.createDataFrame(data, "id long, x double, arr array<double>")
    with pytest.raises(ConfigurationError, match=r"'arr': 1, 'x': 4.*drop_invalid_rows=True"):
        prepare_data(2, store, df, ["id", "arr"], ["x"])
    assert store.list_datasets() == [] and parquet_files_under(store) == []
    meta = prepare_data(2, store, df, ["id", "arr"], ["x"], drop_invalid_rows=True)
    rows, _ = read_all(store, meta)
    assert sorted(rows) == [i for i in range(40) if i % 10 and i != 3]
    assert meta.params["dropped_rows"] == 5


def test_rows_with_another_length_past_the_sample_are_named(spark, store):
    data = [(i, [1.0, 2.0] if i != 70 else [1.0, 2.0, 3.0], 0.0) for i in range(80)]
    df = spark.createDataFrame(data, "id long, arr array<double>, y double").coalesce(1)
    with pytest.raises(
        ConfigurationError,
        match=r"'arr' has 1 row\(s\) whose length differs "
        r"from 2 \(e\.g\. 3\)",
    ):
        prepare_data(1, store, df, ["id", "arr"], ["y"])
    assert store.list_datasets() == [] and parquet_files_under(store) == []


def parquet_files_under(store):
    import os

    return [
        name
        for _, _, names in os.walk(store.prefix_path)
        for name in names
        if name.endswith(".parquet")
    ]


def spark_jobs_of(spark, fn):
    """Number of Spark jobs ``fn()`` starts (counted through a job group of its own)."""
    import uuid

    sc = spark.sparkContext
    group = f"count-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "count jobs")
    try:
        fn()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return len(sc.statusTracker().getJobIdsForGroup(group))


def assembled_df(spark, n=200):
    from pyspark.ml.feature import VectorAssembler

    base = spark.range(n).selectExpr("id", "id * 0.5 as a", "id * 2.0 as b", "id % 3 as y")
    return VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(base)


def test_prepare_data_runs_the_jobs_of_a_plain_repartitioned_write(spark, store, tmp_path):
    """Scalars and assembled vectors need no sample job: no more jobs than the baseline write.

    (One fewer here: the range's two partitions are written without the shuffle.)"""
    df = assembled_df(spark)
    n = 2
    baseline = spark_jobs_of(
        spark,
        lambda: df.select("id", "features", "y").repartition(n).write.parquet(str(tmp_path / "b")),
    )
    box = {}

    def prepare():
        box["meta"] = prepare_data(n, store, df, ["id", "features"], ["y"])

    ours = spark_jobs_of(spark, prepare)
    assert ours == 1 and baseline == 2
    meta = box["meta"]
    assert meta.shapes["features"] == (2,) and meta.columns["features"].kind == "vector"
    rows, _ = read_all(store, meta)
    assert sorted(rows) == list(range(200))
    np.testing.assert_array_equal(rows[7]["features"], [3.5, 14.0])
    # A refit on an equal plan writes nothing and runs no job.
    assert spark_jobs_of(spark, lambda: prepare_data(n, store, df, ["id", "features"], ["y"])) == 0


def test_vector_size_from_metadata_is_checked_on_every_row(spark, store):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    # Column metadata claiming 3 values per row, rows holding 2: the write names the column.
    df = spark.range(50).select(
        "id",
        array_to_vector(F.array(F.col("id") * 1.0, F.lit(1.0))).alias(
            "v", metadata={"ml_attr": {"num_attrs": 3}}
        ),
    )
    with pytest.raises(ConfigurationError, match=r"'v' has 50 row\(s\) whose length differs fro"):
        prepare_data(1, store, df, ["v"], ["id"])
    assert store.list_datasets() == [] and parquet_files_under(store) == []


def test_automatic_partitions_follow_spark_size_estimate(spark, store):
    from spark_estimators.data.prepare import auto_partitions_per_process

    # spark.range estimates 8 bytes per row: 800 kB -> 1 per process; 8 GB -> the cap of 32.
    assert auto_partitions_per_process(spark.range(100_000), 2) == 1
    assert auto_partitions_per_process(spark.range(1_000_000_000), 2) == 32
    meta = prepare_data(2, store, assembled_df(spark), ["features"], ["y"])
    assert meta.params["partitions"] == 2
