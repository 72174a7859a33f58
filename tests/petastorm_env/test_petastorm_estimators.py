"""Estimators with reader="petastorm", end to end on real Spark (issue 30).

Runs in the pinned petastorm environment (``make test-petastorm``: pyspark 4.0.5, pyarrow 14,
numpy 1.26, petastorm 0.13.1); skipped in the main one, where petastorm cannot be installed.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
petastorm = pytest.importorskip(
    "petastorm", reason="petastorm runs in its own pinned environment (make test-petastorm)"
)

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [
    pytest.mark.petastorm,
    pytest.mark.spark,
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), i) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y", "id"]).cache()


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def torch_estimator(store_, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(N_FEATURES, 1)
    opts = dict(
        num_proc=2,
        store=store_,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
        reader="petastorm",
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def test_torch_fit_and_transform_with_the_petastorm_reader(df, store):
    model = torch_estimator(store, validation=0.25).fit(df)
    history = model.getHistory()
    assert history["loss"][-1] < 0.05 < history["loss"][0]
    assert history["val_loss"][-1] < 0.05
    w = model.getModel().weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)
    out = model.transform(df).orderBy("id").collect()
    x = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    with torch.no_grad():
        want = model.getModel()(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose([r["y__output"] for r in out], want, rtol=1e-5, atol=1e-5)


def double_the_label(frame):
    frame["y"] = frame["y"] * 2.0
    return frame


def test_horovods_petastorm_settings_reach_the_reader(df, store):
    # transformation_fn as a petastorm TransformSpec, the process pool, the in-memory cache and a
    # shuffle buffer: the model learns the transformed label, 2 x TRUE_W.
    est = torch_estimator(
        store,
        transformation_fn=double_the_label,
        reader_pool_type="process",
        inmemory_cache_all=True,
        shuffle_buffer_size=64,
        train_reader_num_workers=2,
        epochs=6,
    )
    model = est.fit(df)
    w = model.getModel().weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, 2 * TRUE_W, atol=0.15)


def test_petastorm_settings_are_checked_in_the_driver(df, store):
    with pytest.raises(ConfigurationError, match=r"reader_pool_type='fork' is invalid"):
        torch_estimator(store, reader_pool_type="fork").fit(df)
    # The default reader refuses petastorm's pool, naming the alternative.
    with pytest.raises(ConfigurationError, match=r"reader_pool_type='process'.*reader='petastorm'"):
        torch_estimator(store, reader="arrow", reader_pool_type="process").fit(df)


def test_lightning_fit_with_the_petastorm_reader(df, store):
    pl = pytest.importorskip("pytorch_lightning")
    import torch.nn.functional as F

    from spark_estimators.lightning import LightningEstimator

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(N_FEATURES, 1)

        def forward(self, x):
            return self.fc(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = LightningEstimator(
        num_proc=2,
        store=store,
        model=Linear(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
        reader="petastorm",
    ).fit(df)
    history = model.getHistory()
    assert history["train_loss"][-1] < 0.05 < history["train_loss"][0]
    w = model.getModel().fc.weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)


def test_fit_on_parquet_trains_on_a_petastorm_converter_cache(spark, df, tmp_path):
    # A user who already has petastorm's make_spark_converter cache (Parquet written by Spark,
    # vectors converted to arrays) trains on it without preparing the data again.
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    key = SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF
    old = spark.conf.get(key, None)
    spark.conf.set(key, "file://" + str(tmp_path / "petastorm-cache"))
    try:
        converter = make_spark_converter(df.select("features", "y").repartition(4))
    finally:
        if old is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, old)
    assert len(converter) == 512
    store = LocalStore(str(tmp_path / "store"), train_path=converter.cache_dir_url)
    for reader in ("petastorm", "arrow"):
        model = torch_estimator(store, reader=reader).fit_on_parquet()
        w = model.getModel().weight.detach().numpy().ravel()
        np.testing.assert_allclose(w, TRUE_W, atol=0.1)
    converter.delete()
