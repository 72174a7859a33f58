"""KerasEstimator with custom losses, metrics and registered layers, on 2 ranks of real Spark.

The custom objects are defined here, in a module the ranks cannot import, so they travel by
value; none of the fits below passes ``custom_objects`` unless the test is about it.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.keras import KerasEstimator, KerasModel  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 3
TRUE_W = np.array([1.0, -2.0, 0.5])


def my_huber(y_true, y_pred):
    """A plain custom loss function (not registered, not in custom_objects)."""
    err = keras.ops.abs(y_true - y_pred)
    return keras.ops.mean(keras.ops.where(err < 1.0, 0.5 * err**2, err - 0.5), axis=-1)


def my_abs_error(y_true, y_pred):
    """A plain custom metric function."""
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


@keras.saving.register_keras_serializable(package="zoo")
class ScaleShift(keras.layers.Layer):
    """A registered custom layer: ``x * scale + shift`` with trainable scale and shift."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")
        self.shift = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

    def call(self, x):
        return x * self.scale + self.shift


class Offset(keras.layers.Layer):
    """An unregistered custom layer: ``x + offset``, found in this (driver-imported) module."""

    def build(self, input_shape):
        self.offset = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

    def call(self, x):
        return x + self.offset


@keras.saving.register_keras_serializable(package="zoo")
def zoo_mse(y_true, y_pred):
    """A registered custom loss function."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


class FactorMSE(keras.losses.Loss):
    """A custom Loss class (not registered): its objects travel through their config."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, y_true, y_pred):
        return self.factor * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def scaled_mse(y_true, y_pred, factor=1.0):
    """A loss usually given as ``functools.partial(scaled_mse, factor=...)``: Keras cannot save
    a partial, so a model compiled with it cannot be saved with its compile state."""
    return factor * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("keras-custom-store")))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, N_FEATURES))
    y = x @ TRUE_W + 0.5
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


@pytest.fixture(scope="module")
def sample(df):
    rows = df.limit(16).collect()
    x = np.array([r["features"].toArray() for r in rows], dtype=np.float32)
    y = np.array([[r["y"]] for r in rows], dtype=np.float32)
    return rows, x, y


def fit(store, df, model, **kw):
    opts = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return KerasEstimator(**opts).fit(df)


def dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((N_FEATURES,)), keras.layers.Dense(1)])


def assert_transform_and_reload_predict_alike(spark, model, sample, path):
    rows, x, _ = sample
    want = model.getModel().predict(x, verbose=0).ravel()
    got = [r["y__output"] for r in model.transform(spark.createDataFrame(rows)).collect()]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    model.write().overwrite().save(path)
    reloaded = KerasModel.load(path)
    np.testing.assert_allclose(reloaded.getModel().predict(x, verbose=0).ravel(), want, rtol=1e-6)
    return reloaded


def test_custom_loss_and_metric_functions_come_back_compiled(spark, df, store, sample, tmp_path):
    # Before: every epoch trained, then fit failed rebuilding the model in the driver with
    # "TypeError: Could not locate function 'my_huber'".
    model = fit(store, df, dense_model(), loss=my_huber, metrics=[my_abs_error])
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    assert hist[-1]["my_abs_error"] < hist[0]["my_abs_error"]
    net = model.getModel()
    assert net.compiled and net.loss.__name__ == "my_huber"
    _, x, y = sample
    # The compiled model evaluates with the custom loss and metric it was trained with.
    err = np.abs(y - net.predict(x, verbose=0))
    want_loss = np.mean(np.where(err < 1.0, 0.5 * err**2, err - 0.5))
    got = net.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-4)
    np.testing.assert_allclose(got["my_abs_error"], np.mean(err), rtol=1e-4)
    reloaded = assert_transform_and_reload_predict_alike(spark, model, sample, str(tmp_path / "m"))
    assert reloaded.getModel().compiled
    assert reloaded.getModel().loss.__name__ == "my_huber"


def test_custom_loss_object_trains_and_comes_back_compiled(spark, df, store, sample, tmp_path):
    # Before: the ranks failed unpickling the loss ("Could not locate class 'FactorMSE'").
    model = fit(store, df, dense_model(), loss=FactorMSE(factor=0.5))
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    net = model.getModel()
    assert net.compiled and isinstance(net.loss, FactorMSE) and net.loss.factor == 0.5
    _, x, y = sample
    got = net.evaluate(x, y, batch_size=len(x), verbose=0)
    want = 0.5 * np.mean(np.square(y - net.predict(x, verbose=0)))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    reloaded = assert_transform_and_reload_predict_alike(spark, model, sample, str(tmp_path / "m"))
    assert type(reloaded.getModel().loss).__name__ == "FactorMSE"


def test_unsaveable_loss_gives_uncompiled_model_and_warning(
    spark, df, store, sample, tmp_path, caplog
):
    # Before: the ranks could not unpickle the partial's function (its module went by
    # reference) and, past that, rank 0's first checkpoint failed ("Cannot serialize object
    # functools.partial"), losing the run; now the model comes back uncompiled, with the warning.
    with caplog.at_level(logging.WARNING, logger="spark_estimators.keras"):
        model = fit(store, df, dense_model(), loss=functools.partial(scaled_mse, factor=0.5))
    hist = model.getHistory()
    assert len(hist) == 4 and hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without its compile state" in m and "partial" in m for m in warnings), warnings
    net = model.getModel()
    assert not net.compiled
    w = net.layers[-1].get_weights()[0].ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.2)
    assert_transform_and_reload_predict_alike(spark, model, sample, str(tmp_path / "m"))


@pytest.mark.parametrize(
    "custom_objects", [None, {"ScaleShift": ScaleShift}], ids=["none", "plain-name"]
)
def test_registered_layer_and_loss_travel_to_the_ranks_and_back(
    spark, df, store, sample, tmp_path, custom_objects
):
    # Before: the ranks failed with "Could not locate class 'ScaleShift'" unless both
    # "ScaleShift" and "zoo>ScaleShift" were in custom_objects.
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [keras.Input((N_FEATURES,)), keras.layers.Dense(1, use_bias=False), ScaleShift()]
    )
    model = fit(store, df, net, loss=zoo_mse, custom_objects=custom_objects)
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.2 * hist[0]["loss"]
    trained = model.getModel()
    assert isinstance(trained.layers[-1], ScaleShift)
    assert trained.compiled and trained.loss is zoo_mse
    shift = trained.layers[-1].get_weights()[1]
    assert abs(float(shift[0]) - 0.5) < 0.2  # the layer's own weights trained
    reloaded = assert_transform_and_reload_predict_alike(spark, model, sample, str(tmp_path / "m"))
    assert type(reloaded.getModel().layers[-1]).__name__ == "ScaleShift"
    assert reloaded.getModel().compiled


def test_unregistered_layer_of_an_imported_module_needs_no_custom_objects(
    spark, df, store, sample, tmp_path
):
    # Before: the ranks failed with "Could not locate class 'Offset'" without custom_objects.
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [
            keras.Input((N_FEATURES,)),
            keras.layers.Dense(1, use_bias=False),
            Offset(),
        ]
    )
    model = fit(store, df, net)
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.2 * hist[0]["loss"]
    trained = model.getModel()
    assert isinstance(trained.layers[-1], Offset) and trained.compiled
    assert abs(float(trained.layers[-1].get_weights()[0][0]) - 0.5) < 0.2
    reloaded = assert_transform_and_reload_predict_alike(spark, model, sample, str(tmp_path / "m"))
    assert type(reloaded.getModel().layers[-1]).__name__ == "Offset"
