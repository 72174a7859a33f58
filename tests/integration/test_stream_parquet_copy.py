"""``data="parquet+stream"``: train from the stream while the tasks write the Parquet copy.

The fit learns; the store then holds a published dataset under ``prepare_data``'s cache key, so
a following ``data="parquet"`` fit of the same DataFrame starts no write job and reads exactly the
DataFrame's rows (the same train/validation split as ``prepare_data``'s). A fit whose ranks fail
publishes nothing and leaves no file; refused combinations fail in the driver, naming the Param.
"""

from __future__ import annotations

import glob
import os
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pyarrow.parquet as pq  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from spark_estimators.data import load_dataset_metadata, prepare_data  # noqa: E402
from spark_estimators.errors import ConfigurationError, TrainingFailedError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402
from tests.integration.test_prepare_data_errors import jobs_run_by  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 3
TRUE_W = [1.5, -2.0, 0.5]


def make_df(spark, n=600, partitions=2):
    """Deterministic rows: features (array) and y = features . TRUE_W + 0.7, id for checking.

    ``spark.range`` with ``partitions`` partitions and no shuffle: with 2 (= num_proc) the
    stream keeps them (the unshuffled key and layout); ``repartition`` gives the round-robin.
    """
    df = spark.range(0, n, numPartitions=partitions)
    xs = [F.sin(F.col("id") * (k + 1) * 0.37) * 2 for k in range(N_FEATURES)]
    y = sum(x * w for x, w in zip(xs, TRUE_W, strict=True)) + 0.7
    return df.select(F.array(*xs).alias("features"), y.alias("y"))


def make_estimator(store, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(N_FEATURES, 1)
    opts = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        random_seed=1,
        verbose=0,
        data="parquet+stream",
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def rows_of(files):
    """Multiset of (features..., y) of Parquet files, rounded against float noise."""
    out = Counter()
    for f in files:
        table = pq.read_table(f.path if hasattr(f, "path") else f)
        for feats, y in zip(
            table.column("features").to_pylist(), table.column("y").to_pylist(), strict=True
        ):
            out[(*np.round(feats, 9), round(y, 9))] += 1
    return out


def df_rows(df):
    return Counter(
        (*np.round(r["features"], 9), round(r["y"], 9))
        for r in df.select("features", "y").collect()
    )


def parquet_files(root):
    return sorted(glob.glob(os.path.join(root, "**", "*.parquet"), recursive=True))


@pytest.mark.parametrize("partitions", [2, 3], ids=["kept-partitions", "round-robin"])
def test_fit_leaves_the_copy_that_a_parquet_fit_reuses(spark, tmp_path, partitions):
    df = make_df(spark, partitions=partitions)
    if partitions == 3:
        df = df.repartition(3)  # a shuffle in the plan: the stream deals rows round-robin
    store = LocalStore(str(tmp_path / "store"))
    model = make_estimator(store, validation=0.2).fit(df)
    history = model.getHistory()
    assert history[-1]["loss"] < 0.1 * history[0]["loss"]

    meta = load_dataset_metadata(store)
    assert meta.params["written_while_training"] is True
    assert meta.train_rows + meta.val_rows == 600
    assert 60 < meta.val_rows < 180  # rand(seed) < 0.2
    # The copy is the DataFrame's rows, split exactly as prepare_data splits them.
    assert rows_of(meta.train_files) + rows_of(meta.val_files) == df_rows(df)
    reference = prepare_data(2, LocalStore(str(tmp_path / "ref")), df, ["features"], ["y"], 0.2)
    assert rows_of(meta.val_files) == rows_of(reference.val_files)
    # Nothing but the published files (no staging file of a task attempt) is left.
    assert parquet_files(str(tmp_path / "store")) == sorted(
        f.path for f in meta.train_files + meta.val_files
    )

    files_before = parquet_files(str(tmp_path / "store"))
    reused = {}

    def parquet_fit():
        reused["model"] = make_estimator(store, validation=0.2, data="parquet").fit(df)

    assert jobs_run_by(spark, parquet_fit) == []  # no write job: the cache key matched
    assert parquet_files(str(tmp_path / "store")) == files_before
    assert load_dataset_metadata(store).dataset_idx == meta.dataset_idx
    assert reused["model"].getHistory()[-1]["loss"] < 0.1 * history[0]["loss"]

    # A second parquet+stream fit finds the copy too: it reads Parquet, writes nothing.
    assert jobs_run_by(spark, lambda: make_estimator(store, validation=0.2).fit(df)) == []
    assert parquet_files(str(tmp_path / "store")) == files_before


class FailOnceCopied:
    """A callback that makes every rank fail once its task's copy files are in the store.

    It waits for them (with a deadline): the copy is closed after the partition is read, which
    a rank's epochs may outrun; the message says how many there were.
    """

    def __init__(self, root):
        self.root = root

    def on_epoch_end(self, epoch, logs):
        import time

        deadline = time.monotonic() + 60
        while not parquet_files(self.root) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"boom after {len(parquet_files(self.root))} copy files")


def test_a_failed_fit_publishes_nothing_and_removes_its_files(spark, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    estimator = make_estimator(store, epochs=2, callbacks=[FailOnceCopied(str(tmp_path))])
    with pytest.raises(TrainingFailedError, match="boom after [1-9][0-9]* copy files"):
        estimator.fit(make_df(spark))
    assert parquet_files(str(tmp_path)) == []
    assert not glob.glob(os.path.join(str(tmp_path), "**", "*.metadata.json"), recursive=True)
    assert store.list_datasets() == []


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(partitions_per_process=2), "partitions_per_process=2 has no effect with "
         "data='parquet\\+stream'"),
        (dict(reader="petastorm"), "reader='petastorm' reads Parquet; data='parquet\\+stream'"),
        (dict(elastic=True), "elastic=True .* data='parquet\\+stream'"),
        (dict(data="parquet-stream"), "data='parquet-stream' is invalid"),
    ],
)  # fmt: skip
def test_refused_combinations_fail_in_the_driver_naming_the_param(spark, tmp_path, kw, message):
    df = make_df(spark)
    store = LocalStore(str(tmp_path / "store"))

    def fit():
        with pytest.raises(ConfigurationError, match=message):
            make_estimator(store, **kw).fit(df)

    assert jobs_run_by(spark, fit) == []
    assert parquet_files(str(tmp_path)) == []
