"""KerasEstimator with named (dict) outputs and vector labels (issue 44 item 4).

A functional model with ``outputs={"b": ..., "a": ...}`` fits with dict ``loss`` and
``loss_weights`` and transforms to one column per output (Keras's order, ``model.output_names``);
a vector label's output comes back as a ``VectorUDT`` column, as horovod wrote it.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402
from pyspark.sql.types import ArrayType, DoubleType  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.keras import KerasEstimator, KerasModel  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_ROWS = 64


def named_model(seed=0):
    """Two named outputs, given in the dict in the opposite order to Keras's (sorted) one."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inp)
    b = keras.layers.Dense(2, name="b")(hidden)
    a = keras.layers.Dense(1, name="a")(hidden)
    return keras.Model(inp, {"b": b, "a": a})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("keras-named-store")))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N_ROWS, 4))
    rows = [
        (
            Vectors.dense(x[i].tolist()),
            float(x[i].sum()),  # label of output "a" (1 wide)
            [float(x[i, 0]), float(-x[i, 1])],  # label of output "b" (2 wide)
            Vectors.sparse(3, [i % 3], [1.0]),  # one-hot, as OneHotEncoder writes it
            i,
        )
        for i in range(N_ROWS)
    ]
    return spark.createDataFrame(rows, ["features", "ya", "yb", "label_vec", "id"]).cache()


def named_estimator(store, **kw):
    opts = dict(
        num_proc=2,
        store=store,
        model=named_model(),
        optimizer=keras.optimizers.SGD(0.01),
        loss={"a": "mse", "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.5},
        feature_cols=["features"],
        label_cols=["ya", "yb"],  # model.output_names == ["a", "b"]
        batch_size=8,
        epochs=2,
        random_seed=1,
        verbose=0,
    )
    opts.update(kw)
    return KerasEstimator(**opts)


@pytest.fixture(scope="module")
def fitted(df, store):
    return named_estimator(store, run_id="named_outputs").fit(df)


def predict_rows(model, rows):
    x = np.array([r["features"].toArray() for r in rows], dtype=np.float32)
    return model.getModel().predict(x, verbose=0)


def test_named_outputs_fit_and_transform_equals_predict(fitted, df):
    history = fitted.getHistory()
    assert [h["epoch"] for h in history] == [0, 1]
    # The dict loss and loss_weights reached model.compile: one loss per named output.
    assert {"a_loss", "b_loss"} <= set(history[-1])
    out = fitted.transform(df)
    assert out.schema["ya__output"].dataType == DoubleType()
    assert out.schema["yb__output"].dataType == ArrayType(DoubleType(), False)
    rows = out.orderBy("id").collect()
    want = predict_rows(fitted, rows)
    assert set(want) == {"a", "b"}
    got_a = np.array([r["ya__output"] for r in rows])
    got_b = np.array([r["yb__output"] for r in rows])
    np.testing.assert_allclose(got_a, want["a"].ravel(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_b, want["b"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # make test keeps the fit/transform and the driver checks
def test_named_outputs_pipeline_save_load(fitted, df, tmp_path):
    fitted.setOutputCols(["pa", "pb"])
    try:
        path = str(tmp_path / "pm")
        PipelineModel(stages=[fitted]).write().overwrite().save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the keyless load warns; not what is tested here
            loaded = PipelineModel.load(path)
        stage = loaded.stages[0]
        assert isinstance(stage, KerasModel)
        rows = loaded.transform(df).orderBy("id").collect()
    finally:
        fitted.setOutputCols([])
    want = predict_rows(fitted, rows)
    np.testing.assert_allclose([r["pa"] for r in rows], want["a"].ravel(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([r["pb"] for r in rows], want["b"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # make test keeps the fit/transform and the driver checks
def test_dict_loss_weights_are_accepted_and_survive_a_pipeline(store, tmp_path):
    est = named_estimator(store)
    assert est.getLossWeights() == {"a": 1.0, "b": 0.5}
    pipe_path = str(tmp_path / "pipe")
    Pipeline(stages=[est]).write().overwrite().save(pipe_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Pipeline.load(pipe_path).getStages()[0]
    assert loaded.getLossWeights() == {"a": 1.0, "b": 0.5}


@pytest.mark.parametrize(
    ("keyword", "value", "unknown"),
    [
        ("loss_weights", {"a": 1.0, "c": 0.5}, "'c'"),
        ("loss", {"a": "mse", "bb": "mse"}, "'bb'"),
    ],
)
def test_unknown_output_name_is_refused_in_the_driver(spark, df, store, keyword, value, unknown):
    sc = spark.sparkContext
    group = f"issue44-refusal-{keyword}"
    sc.setJobGroup(group, "must start no job")
    try:
        with pytest.raises(ConfigurationError) as err:
            named_estimator(store, **{keyword: value}).fit(df)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    message = str(err.value)
    assert keyword in message and unknown in message and "['a', 'b']" in message
    assert sc.statusTracker().getJobIdsForGroup(group) == []


def test_label_count_must_match_the_named_outputs(df, store):
    with pytest.raises(ConfigurationError, match=r"2 outputs \['a', 'b'\].*1 column"):
        named_estimator(store, label_cols=["ya"], loss_weights=None).fit(df)


def test_labels_in_the_dicts_written_order_are_refused_before_training(df, store):
    # The dict was written {"b": ..., "a": ...}, but Keras orders the outputs ["a", "b"].
    with pytest.raises(ConfigurationError, match=r"output 'a' .* 1 value.*'yb'.* holds 2"):
        named_estimator(store, label_cols=["yb", "ya"]).fit(df)


def test_vector_label_gives_a_vector_output(df, store, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    est = KerasEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=keras.optimizers.SGD(0.01),
        loss="categorical_crossentropy",
        feature_cols=["features"],
        label_cols=["label_vec"],
        batch_size=8,
        epochs=1,
        random_seed=1,
        verbose=0,
    )
    fitted = est.fit(df).setOutputCols(["label_prob"])
    out = fitted.transform(df)
    assert isinstance(out.schema["label_prob"].dataType, VectorUDT)
    rows = out.orderBy("id").collect()
    got = np.array([r["label_prob"].toArray() for r in rows])
    want = predict_rows(fitted, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Saved and loaded, the model still writes a vector.
    path = str(tmp_path / "vec_model")
    fitted.write().overwrite().save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = KerasModel.load(path)
    assert isinstance(loaded.transform(df).schema["label_prob"].dataType, VectorUDT)
