"""issue 25 item 7: KerasEstimator takes input shapes from ``model.inputs`` (horovod's rule).

horovod's examples/spark/keras/keras_spark_mnist.py feeds a 784-long vector column to a Conv2D
model with ``Input((28, 28, 1))`` and gives no input_shapes; it failed with Keras's "Invalid
input shape". Here the same on 4 x 4 images.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.keras import KerasEstimator  # noqa: E402
from spark_estimators.keras.estimator import model_input_shapes  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def conv_model(side=4):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((side, side, 1)),
            keras.layers.Conv2D(2, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


@pytest.fixture(scope="module")
def images(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16))
    y = x[:, :4].sum(axis=1)
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]), x


def estimator(tmp_path, model, **kw):
    return KerasEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=keras.optimizers.SGD(0.01),
        loss="mse",
        feature_cols=kw.pop("feature_cols", ["features"]),
        label_cols=["y"],
        batch_size=8,
        epochs=kw.pop("epochs", 3),
        verbose=0,
        **kw,
    )


def test_vector_column_feeds_an_image_input_without_input_shapes(images, tmp_path):
    df, x = images
    est = estimator(tmp_path, conv_model())
    assert est.getOrDefault(est.inputShapes) is None
    assert est.getInputShapes() == [[-1, 4, 4, 1]]
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert len(history) == 3 and history[-1]["loss"] < history[0]["loss"]
    assert fitted.getInputShapes() == [[-1, 4, 4, 1]]  # transform reshapes the same way
    out = fitted.transform(df).select("features", "y__output").collect()
    got = np.array([r["y__output"] for r in out])
    feats = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    want = fitted.getModel().predict(feats.reshape(-1, 4, 4, 1), verbose=0).ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rows_that_cannot_fill_the_models_input_fail_in_the_driver(images, tmp_path):
    df, _ = images
    with pytest.raises(ConfigurationError, match=r"model\.inputs.*'features'.*\[-1, 5, 5, 1\].*16"):
        estimator(tmp_path, conv_model(side=5)).fit(df)


def test_one_feature_column_per_model_input(images, tmp_path):
    df, _ = images
    a, b = keras.Input((16,)), keras.Input((1,))
    two_inputs = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    with pytest.raises(ConfigurationError, match="model has 2 input.*feature_cols names 1"):
        estimator(tmp_path, two_inputs).fit(df)


def test_given_input_shapes_win(images, tmp_path):
    est = estimator(tmp_path, conv_model(), input_shapes=[[4, 4, 1]])
    assert est.getInputShapes() == [[4, 4, 1]]


def test_shapes_from_inputs_with_unknown_dimensions():
    seq = keras.Sequential([keras.Input((None, 8)), keras.layers.Dense(1)])
    assert model_input_shapes(seq, 1) == [[-1, 8]]  # per row: any number of 8-long steps
    free = keras.Sequential([keras.Input((None, None)), keras.layers.Activation("relu")])
    assert model_input_shapes(free, 1) is None  # cannot be told: the column as it is
    assert model_input_shapes(seq, 2) is None  # another count: validation reports it
