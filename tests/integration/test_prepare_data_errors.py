"""Bad input to prepare_data fails in the driver with a message naming the value and the fix."""

from __future__ import annotations

import uuid

import pytest

from spark_estimators.data import prepare_data
from spark_estimators.data.columns import SPLIT_COL
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


@pytest.fixture
def df(spark):
    return spark.range(20).selectExpr(
        "id",
        "cast(id as double) as x",
        "array(cast(id as double), 1.0) as arr",
        "cast(id as string) as name",
        "current_timestamp() as ts",
        "map('a', id) as m",
        "cast(id as decimal(10, 2)) as dec",
        "id % 2 = 0 as flag",
        "array(1.5) as decs",
    )


def jobs_run_by(spark, fn):
    """Call fn() under a fresh job group and return the ids of the Spark jobs it started."""
    sc = spark.sparkContext
    group = f"test-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "prepare_data input checks")
    try:
        fn()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return list(sc.statusTracker().getJobIdsForGroup(group))


CASES = [
    (dict(feature_cols=["x", "nope"]), r"\['nope'\] not found.*available columns: \['id', 'x'"),
    (dict(label_cols=["missing"]), r"\['missing'\] not found"),
    (dict(feature_cols=["name"]), r"'name' is a string column.*StringIndexer\(inputCol='name'"),
    (dict(feature_cols=["ts"]), r"'ts' has unsupported type 'timestamp'; supported: numbers"),
    (dict(feature_cols=["m"]), r"'m' has unsupported type 'map<string,bigint>'"),
    (dict(feature_cols=["decs"]), r"'decs' has unsupported type 'array<decimal\(2,1\)>' \(cast"),
    (
        dict(feature_cols=["dec"]),
        r"'dec' has unsupported type 'decimal\(10,2\)' \(cast it to double",
    ),
    (dict(validation=1.0), r"validation=1\.0 must be a fraction in \[0, 1\)"),
    (dict(validation=-0.1), r"validation=-0\.1 must be a fraction in \[0, 1\)"),
    (dict(validation=True), r"validation=True must be a fraction"),
    (dict(validation="name"), r"validation column 'name' is a string column"),
    (dict(validation="arr"), r"validation column 'arr' has unsupported type 'array<double>'"),
    (dict(validation="x"), r"validation column 'x' is also a feature"),
    (dict(num_proc=0), r"num_proc=0 must be a positive integer"),
    (dict(partitions_per_process=0), r"partitions_per_process=0 must be a positive integer"),
    (dict(feature_cols=[]), r"feature_cols is empty"),
    (dict(feature_cols=["x"], label_cols=["x"]), r"\['x'\] are named more than once"),
    (dict(store="/tmp/not-a-store"), r"store='/tmp/not-a-store' is not a Store.*Store\.create"),
]


@pytest.mark.parametrize(("overrides", "message"), CASES)
def test_bad_arguments_fail_before_any_job(spark, store, df, overrides, message):
    args = dict(
        num_proc=2, store=store, df=df, feature_cols=["x"], label_cols=["flag"], validation=None
    )
    args.update(overrides)

    def call():
        with pytest.raises(ConfigurationError, match=message):
            prepare_data(**args)

    assert jobs_run_by(spark, call) == []
    assert store.list_datasets() == []


def test_empty_dataframe_is_refused(spark, store, df):
    with pytest.raises(ConfigurationError, match=r"the DataFrame is empty \(0 rows\)"):
        prepare_data(2, store, df.filter("id < 0"), ["x"], ["flag"])


@pytest.mark.parametrize(
    ("label_expr", "found"),
    [("cast(null as array<double>)", "only nulls"), ("cast(array() as array<double>)", "an empty")],
)
def test_label_shapes_that_cannot_be_inferred(spark, store, df, label_expr, found):
    frame = df.selectExpr("x", f"{label_expr} as y")
    with pytest.raises(ConfigurationError, match=f"cannot infer the shape of column 'y'.*{found}"):
        prepare_data(2, store, frame, ["x"], ["y"])


def test_rows_of_different_lengths_in_the_sample(spark, store, df):
    frame = df.selectExpr("x", "case when id = 1 then array(x) else array(x, x) end as y")
    with pytest.raises(ConfigurationError, match=r"'y' has rows of different lengths \(\[1, 2\]"):
        prepare_data(2, store, frame, ["x"], ["y"])


def test_prepare_data_refuses_to_run_inside_a_task(spark, store):
    def inside(_):
        try:
            prepare_data(1, store, None, ["x"])
        except RuntimeError as exc:
            yield str(exc)

    (message,) = spark.sparkContext.parallelize([0], 1).mapPartitions(inside).collect()
    assert "only be called on the Spark driver" in message


@pytest.mark.parametrize("used", [False, True], ids=["unused", "feature"])
def test_a_column_named_like_the_internal_validation_flag_is_refused(spark, store, df, used):
    """The name is ours: refused before any job, naming the column and the fix (issue 40)."""
    frame = df.selectExpr("x", "flag", f"not flag as {SPLIT_COL}")
    features = ["x", SPLIT_COL] if used else ["x"]
    message = (
        rf"column named '{SPLIT_COL}', a name spark_estimators reserves.*"
        rf"withColumnRenamed\('{SPLIT_COL}', 'is_val'\), and pass validation='is_val'"
    )

    def call():
        with pytest.raises(ConfigurationError, match=message):
            prepare_data(2, store, frame, features, ["flag"], validation=0.5)

    assert jobs_run_by(spark, call) == []
    assert store.list_datasets() == []
