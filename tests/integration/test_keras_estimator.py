"""KerasEstimator end to end on real Spark with 2 processes and small data."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.keras import KerasEstimator, KerasModel  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


def linear_model(seed=0, n_in=N_FEATURES):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((n_in,)), keras.layers.Dense(1)])


class ScaledDense(keras.layers.Layer):
    """A custom layer (not registered with Keras): needs custom_objects to load."""

    def __init__(self, units, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.units, self.scale = units, scale

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), initializer="zeros")
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros")

    def call(self, x):
        return self.scale * (x @ self.kernel) + self.bias

    def get_config(self):
        return {**super().get_config(), "units": self.units, "scale": self.scale}


def half_mse(y_true, y_pred):
    return 0.5 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def make_df(spark, n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i]), float(x[i, 0])) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y", "x0"])


def make_estimator(store_, **kw):
    model = kw.pop("model", None) or linear_model()
    opts = dict(
        num_proc=2,
        store=store_,
        model=model,
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return KerasEstimator(**opts)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("keras-store")))


@pytest.fixture(scope="module")
def df(spark):
    return make_df(spark).cache()


@pytest.fixture(scope="module")
def fitted(df, store):
    est = make_estimator(store, validation=0.25, metrics=["mae"], run_id="keras_main")
    return est, est.fit(df)


def test_loss_decreases_below_bound_with_validation_history(fitted):
    _, model = fitted
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.05 < history[0]["loss"]
    assert history[-1]["val_loss"] < 0.05
    assert history[-1]["mae"] < history[0]["mae"]
    assert "val_mae" in history[-1]
    w = model.getModel().layers[-1].get_weights()[0].ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)
    # Both ranks ended with bitwise identical trainable weights.
    prints = model._rank_fingerprints
    assert len(prints) == 2 and prints[0] == prints[1]


def test_transform_equals_model_predict(fitted, df):
    _, model = fitted
    out = model.transform(df).select("features", "y__output").collect()
    x = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    got = np.array([r["y__output"] for r in out])
    want = model.getModel().predict(x, verbose=0).ravel()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_checkpoint_and_tensorboard_logs_in_the_store(fitted, store):
    _, model = fitted
    assert model.getRunId() == "keras_main"
    ckpt_dir = store.get_checkpoint_path("keras_main")
    assert {"checkpoint.keras", "checkpoint.json"} <= set(store.listdir(ckpt_dir))
    logs = store.get_logs_path("keras_main")
    events = []
    for sub in store.listdir(logs):
        events += [n for n in store.listdir(f"{logs}/{sub}") if "tfevents" in n]
    assert events, f"no TensorBoard event files under {logs}"
    local = os.path.join(store.fs_path(ckpt_dir), "checkpoint.keras")
    loaded = keras.saving.load_model(local)
    # Saved with the distributed optimizer, reloaded as the plain one.
    assert type(loaded.optimizer) is keras.optimizers.SGD


def test_hot_start_resumes_after_the_last_epoch(fitted, df, store):
    _, first = fitted
    steps = int(first.getModel().optimizer.iterations.numpy()) // 4
    resumed = make_estimator(store, validation=0.25, metrics=["mae"], run_id="keras_main", epochs=5)
    model = resumed.fit(df)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3, 4]
    assert history[:4] == first.getHistory()  # the saved epochs, not retrained
    # Weights and optimizer state came from the checkpoint: training continued, not restarted.
    assert history[4]["loss"] < history[1]["loss"]
    assert int(model.getModel().optimizer.iterations.numpy()) == 5 * steps


def test_hot_start_on_fewer_ranks_rescales_the_learning_rate(df, store):
    # scale_lr (the default): the rate is 0.05 x ranks. The checkpoint of a 2-rank run holds
    # 0.1; a hot start on 1 rank (as after an elastic relaunch with fewer) must train at 0.05.
    first = make_estimator(store, epochs=1, run_id="keras_resize").fit(df)
    assert float(first.getModel().optimizer.learning_rate.numpy()) == pytest.approx(0.1)
    resumed = make_estimator(store, epochs=2, run_id="keras_resize", num_proc=1).fit(df)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1]
    assert float(resumed.getModel().optimizer.learning_rate.numpy()) == pytest.approx(0.05)


def test_pipeline_save_load_round_trip(fitted, df, tmp_path):
    est, model = fitted
    pm = PipelineModel(stages=[model])
    path = str(tmp_path / "pm")
    pm.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    stage = loaded.stages[0]
    assert isinstance(stage, KerasModel)
    assert isinstance(stage.getModel(), keras.Model)
    a = [r["y__output"] for r in pm.transform(df).orderBy("x0").collect()]
    b = [r["y__output"] for r in loaded.transform(df).orderBy("x0").collect()]
    assert a == b
    assert stage.getHistory() == model.getHistory()
    pipe = Pipeline(stages=[est])
    pipe.write().overwrite().save(str(tmp_path / "pipe"))
    est2 = Pipeline.load(str(tmp_path / "pipe")).getStages()[0]
    assert isinstance(est2, KerasEstimator)
    assert est2.getStore() is None
    assert est2.getFeatureCols() == ["features"] and est2.getEpochs() == 4


def test_two_ranks_of_b_equal_one_rank_of_2b(spark, store):
    # One full batch per step: 2 ranks x 32 rows average to exactly the 64-row gradient.
    small = make_df(spark, n=64, seed=5)

    def fit(num_proc, batch):
        est = make_estimator(
            store,
            model=linear_model(seed=3),
            optimizer=keras.optimizers.SGD(0.1),
            num_proc=num_proc,
            batch_size=batch,
            epochs=3,
            shuffle=False,
            scale_lr=False,
        )
        return [w.copy() for w in est.fit(small).getModel().get_weights()]

    two, one = fit(2, 32), fit(1, 64)
    init = linear_model(seed=3).get_weights()
    assert np.abs(two[0] - init[0]).max() > 0.05  # trained, so the comparison means something
    for a, b in zip(two, one):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_early_stopping_stops_all_ranks_and_checkpoint_callback_picks_weights(df, store):
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    # "Best" = highest loss: the epoch-0 weights, so the returned model is not the last one.
    first = keras.callbacks.ModelCheckpoint(
        "first.weights.h5", monitor="loss", mode="max", save_best_only=True, save_weights_only=True
    )
    est = make_estimator(
        store, epochs=5, callbacks=[stopper], checkpoint_callback=first, run_id="keras_early"
    )
    model = est.fit(df)
    # min_delta is huge: epoch 1 never "improves", so every rank stops after epoch 1.
    assert [h["epoch"] for h in model.getHistory()] == [0, 1]
    assert len(set(model._rank_fingerprints)) == 1
    ckpt_dir = store.get_checkpoint_path("keras_early")
    assert "first.weights.h5" in store.listdir(ckpt_dir)
    saved = linear_model()
    saved.load_weights(os.path.join(store.fs_path(ckpt_dir), "first.weights.h5"))
    last = keras.saving.load_model(os.path.join(store.fs_path(ckpt_dir), "checkpoint.keras"))
    got = model.getModel().get_weights()
    for a, b in zip(got, saved.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got[0], last.get_weights()[0])


def test_sample_weights_change_the_fit(spark, store):
    # Two groups disagree on y; the weights decide which one the constant model follows.
    rows = [(Vectors.dense([1.0]), 0.0, 1.0) for _ in range(64)]
    rows += [(Vectors.dense([1.0]), 10.0, 9.0) for _ in range(64)]
    wdf = spark.createDataFrame(rows, ["features", "y", "w"])
    est = make_estimator(
        store,
        model=linear_model(n_in=1),
        # Keras divides the weighted loss by the rows, not the weights: mean weight 5 makes the
        # step 5x larger, hence the small rate.
        optimizer=keras.optimizers.SGD(0.01),
        sample_weight_col="w",
        batch_size=16,
        epochs=10,
        scale_lr=False,
    )
    pred = float(est.fit(wdf).getModel().predict(np.ones((1, 1), np.float32), verbose=0)[0, 0])
    assert abs(pred - 9.0) < 0.6  # (0 * 1 + 10 * 9) / 10; unweighted it would be 5


def test_custom_objects_train_transform_and_reload(spark, df, store, tmp_path):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((N_FEATURES,)), ScaledDense(1, scale=2.0)])
    custom = {"ScaledDense": ScaledDense, "half_mse": half_mse}
    est = make_estimator(store, model=net, loss=half_mse, custom_objects=custom, epochs=3)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist[-1]["loss"] < 0.2 * hist[0]["loss"]
    keras_net = model.getModel()
    assert isinstance(keras_net.layers[-1], ScaledDense)
    assert keras_net.layers[-1].scale == 2.0
    assert keras_net.loss is not None  # compiled: the custom loss loaded too
    rows = df.limit(16).collect()
    x = np.array([r["features"].toArray() for r in rows], dtype=np.float32)
    want = keras_net.predict(x, verbose=0).ravel()
    got = [r["y__output"] for r in model.transform(spark.createDataFrame(rows)).collect()]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    path = str(tmp_path / "keras_model")
    model.write().overwrite().save(path)
    reloaded = KerasModel.load(path)
    assert isinstance(reloaded.getModel().layers[-1], ScaledDense)
    np.testing.assert_allclose(reloaded.getModel().predict(x, verbose=0).ravel(), want, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"feature_cols": ["nope"]}, r"column\(s\) \['nope'\] not found.*available columns"),
        ({"model": "not a model"}, "model must be a keras.Model"),
        ({"optimizer": object()}, "optimizer must be a keras.optimizers.Optimizer"),
        ({"loss": None}, "loss is required"),
        ({"backward_passes_per_step": 2}, "gradient_accumulation_steps"),
        ({"callbacks": [object()]}, "callbacks must be keras.callbacks.Callback"),
        ({"checkpoint_callback": object()}, "checkpoint_callback must be a .*ModelCheckpoint"),
        ({"custom_objects": ["x"]}, "custom_objects must be a dict"),
        ({"loss": ["mse", "mse", "mse"]}, "3 losses for 1 label columns"),
        (
            {
                "optimizer": keras.optimizers.SGD(
                    keras.optimizers.schedules.ExponentialDecay(1, 2, 3)
                )
            },
            "scale the schedule yourself and pass scale_lr=False",
        ),
    ],
)
def test_bad_input_fails_in_driver(df, store, kwargs, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        make_estimator(store, **kwargs).fit(df)


def test_unknown_keyword_suggests_the_right_one(store):
    with pytest.raises(ConfigurationError, match="unknown keyword 'custom_object'.*custom_objects"):
        make_estimator(store, custom_object={})
