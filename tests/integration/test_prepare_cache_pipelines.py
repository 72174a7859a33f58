"""issue 25 item 12: prepare_data reuses its dataset for DataFrames built through ML transformers.

Two DataFrames built the same way through ``VectorAssembler`` have different ``semanticHash()``
(the ScalaUDF's closure object is new at every ``transform``), so every refit of a feature
pipeline wrote its data again. The cache must hit for equal pipelines and still miss for any
change: other input columns, other source data, a scaler fitted on other data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from spark_estimators.data import prepare_data
from spark_estimators.data.cache_key import plan_fingerprint
from spark_estimators.store import LocalStore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def write_source(spark, path, n=40, scale=1.0):
    rows = [(float(i) * scale, float(i % 7), float(i % 3), float(i % 2)) for i in range(n)]
    spark.createDataFrame(rows, ["a", "b", "c", "y"]).write.mode("overwrite").parquet(path)


def assembled(spark, path, cols=("a", "b")):
    from pyspark.ml.feature import VectorAssembler

    df = spark.read.parquet(path).filter("a >= 0")
    return VectorAssembler(inputCols=list(cols), outputCol="features").transform(df)


def scaled(spark, path, fit_rows):
    from pyspark.ml.feature import StandardScaler

    df = assembled(spark, path)
    scaler = StandardScaler(inputCol="features", outputCol="scaled").fit(df.limit(fit_rows))
    return scaler.transform(df)


def test_equal_pipelines_hit_and_any_change_misses(spark, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    source = str(tmp_path / "source")
    write_source(spark, source)
    # the premise: Spark's own hash differs for equal pipelines
    assert assembled(spark, source).semanticHash() != assembled(spark, source).semanticHash()

    first = prepare_data(2, store, assembled(spark, source), ["features"], ["y"])
    files = sorted(store.listdir(first.train_path))
    again = prepare_data(2, store, assembled(spark, source), ["features"], ["y"])
    assert again == first and sorted(store.listdir(first.train_path)) == files
    assert store.list_datasets() == [first.dataset_idx]

    other_cols = prepare_data(2, store, assembled(spark, source, ("a", "c")), ["features"], ["y"])
    assert other_cols.dataset_idx != first.dataset_idx
    # fitted transformers: the same fit hits, a fit on other rows misses
    scaled_20 = prepare_data(2, store, scaled(spark, source, 20), ["scaled"], ["y"])
    assert prepare_data(2, store, scaled(spark, source, 20), ["scaled"], ["y"]) == scaled_20
    scaled_30 = prepare_data(2, store, scaled(spark, source, 30), ["scaled"], ["y"])
    assert scaled_30.dataset_idx != scaled_20.dataset_idx
    # other source data under the same path
    write_source(spark, source, n=41, scale=2.0)
    new_data = prepare_data(2, store, assembled(spark, source), ["features"], ["y"])
    assert new_data.dataset_idx not in (first.dataset_idx, other_cols.dataset_idx)
    assert new_data.train_rows + new_data.val_rows == 41
    assert len(store.list_datasets()) == 5


def test_plans_without_ml_transformers_keep_the_semantic_hash(spark):
    df = spark.range(10).selectExpr("id", "id * 2 as x")
    assert plan_fingerprint(df) == df.semanticHash()


def test_rdd_backed_data_through_a_transformer_is_never_served_stale(spark):
    from pyspark.ml.feature import VectorAssembler

    def build(v):
        df = spark.createDataFrame([(v, 1.0), (2.0, 0.0)], ["a", "y"])
        return VectorAssembler(inputCols=["a"], outputCol="features").transform(df)

    # the rows live in an RDD the plan cannot show: other data must not hit
    assert plan_fingerprint(build(1.0)) != plan_fingerprint(build(5.0))


def plain(spark, path):
    return spark.read.parquet(path).filter("a >= 0").select("a", "b", "y")


def test_a_new_driver_process_computes_the_same_fingerprint(spark, tmp_path):
    # A file relation's semanticHash differs in every driver process (its format's JVM identity
    # hash): prepared data was never found by a new driver, with or without transformers.
    source = str(tmp_path / "source")
    write_source(spark, source)
    here = [plan_fingerprint(assembled(spark, source)), plan_fingerprint(plain(spark, source))]
    assert all(isinstance(fp, dict) for fp in here)
    script = textwrap.dedent(
        f"""
        import json, sys
        from pyspark.sql import SparkSession
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_prepare_cache_pipelines import assembled, plain
        from spark_estimators.data.cache_key import plan_fingerprint
        spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
                 .config("spark.driver.host", "127.0.0.1").getOrCreate())
        try:
            fps = [plan_fingerprint(f(spark, {source!r})) for f in (assembled, plain)]
            print("FP " + json.dumps(fps))
        finally:
            spark.stop()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FP ")]
    assert lines, proc.stderr[-3000:]
    assert json.loads(lines[0][3:]) == here
    # and a changed plan on the same files is another fingerprint
    other = spark.read.parquet(source).filter("a >= 1").select("a", "b", "y")
    assert plan_fingerprint(other) != here[1]


def feature_cell(spark, store, source, fit_source=None, with_mean=False, validation=0.0):
    """A notebook cell: build the whole feature pipeline anew, fit it, prepare the data.

    The source has int and string columns: VectorAssembler casts the ints with aliases that
    carry its uid (``a_double_VectorAssembler_<uid>``), and the string goes through a
    StringIndexer and a OneHotEncoder; everything is fitted again at every run, as a re-run
    cell does.
    """
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import OneHotEncoder, StandardScaler, StringIndexer, VectorAssembler

    df = spark.read.parquet(source)
    pipeline = Pipeline(
        stages=[
            StringIndexer(inputCol="cat", outputCol="cat_idx", handleInvalid="keep"),
            OneHotEncoder(inputCol="cat_idx", outputCol="cat_vec"),
            VectorAssembler(inputCols=["n", "b", "cat_vec"], outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features", withMean=with_mean),
        ]
    )
    fitted = pipeline.fit(spark.read.parquet(fit_source or source))
    return prepare_data(2, store, fitted.transform(df), ["features"], ["y"], validation=validation)


def write_mixed_source(spark, path, n=40, cats="abc", scale=1):
    rows = [(i * scale, float(i % 7), cats[i % len(cats)], float(i % 2)) for i in range(n)]
    spark.createDataFrame(rows, ["n", "b", "cat", "y"]).write.mode("overwrite").parquet(path)


def _written(store, meta):
    """Every file of the dataset with its modification time: a second write changes them."""
    root = meta.train_path.removeprefix("file://")
    return sorted((f, os.stat(os.path.join(root, f)).st_mtime_ns) for f in os.listdir(root))


def test_a_rerun_cell_reuses_its_data_and_changes_still_miss(spark, tmp_path):
    """Issue 41: the same cell run twice hits; other data, params or fits miss."""
    store = LocalStore(str(tmp_path / "store"))
    source, other = str(tmp_path / "source"), str(tmp_path / "other")
    write_mixed_source(spark, source)
    write_mixed_source(spark, other, cats="abd", scale=3)

    first = feature_cell(spark, store, source)
    files = _written(store, first)
    again = feature_cell(spark, store, source)  # the cell re-run: new stages, new uids
    assert again == first
    assert _written(store, again) == files  # nothing written again
    assert store.list_datasets() == [first.dataset_idx]

    # what must miss: the pipeline fitted on other data (other labels, other scaling)
    refit = feature_cell(spark, store, source, fit_source=other)
    # another stage param, another preparation param
    centred = feature_cell(spark, store, source, with_mean=True)
    split = feature_cell(spark, store, source, validation=0.25)
    # other data under another path and then under the same path
    elsewhere = feature_cell(spark, store, other)
    write_mixed_source(spark, source, n=41)
    rewritten = feature_cell(spark, store, source)
    indices = [m.dataset_idx for m in (first, refit, centred, split, elsewhere, rewritten)]
    assert len(set(indices)) == len(indices), indices
    assert rewritten.train_rows + rewritten.val_rows == 41
    assert _written(store, first) == files  # the first dataset is untouched


def test_string_literals_that_look_like_ids_are_kept(spark, tmp_path):
    """Only stage uids are renumbered: a filter on ``sess_<12 hex>`` keeps its value."""
    source = str(tmp_path / "source")
    write_mixed_source(spark, source)

    def cell(session_id):
        from pyspark.ml.feature import VectorAssembler

        df = spark.read.parquet(source).filter(f"cat != '{session_id}'")
        return VectorAssembler(inputCols=["n", "b"], outputCol="features").transform(df)

    ids = ("sess_0123456789ab", "sess_0123456789ab", "sess_ba9876543210")
    one, same, other = (cell(session_id) for session_id in ids)
    assert plan_fingerprint(one) == plan_fingerprint(same)
    assert plan_fingerprint(one) != plan_fingerprint(other)
