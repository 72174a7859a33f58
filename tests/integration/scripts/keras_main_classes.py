"""Keras classes defined in ``__main__``, as a notebook defines them (issue 41).

Run: ``python keras_main_classes.py MODE STORE_DIR`` with MODE ``none`` (no custom_objects),
``plain`` (``custom_objects={"Name": cls}``) or ``package`` (``{"package>Name": cls}``).
Fits a registered layer inside a subclassed ``keras.Model``, both defined here, on 2 ranks;
transforms, saves and loads the Spark model and the saved ``.keras`` model, and prints one
``RESULT {json}`` line with the predictions of each against the driver's own.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.session import create_local_session  # noqa: E402
from spark_estimators.keras import KerasEstimator, KerasModel  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402


@keras.saving.register_keras_serializable(package="nb")
class Scale(keras.layers.Layer):
    """A registered layer: ``x * scale`` with a trainable scale."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale


class Regressor(keras.Model):
    """A subclassed model (not registered) holding the registered layer."""

    def __init__(self, units=1, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.scale = Scale()
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(self.scale(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def main(mode, store_dir):
    spark = create_local_session()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.5
    df = spark.createDataFrame(
        [(Vectors.dense(r.tolist()), float(t)) for r, t in zip(x, y, strict=True)],
        ["features", "y"],
    )
    custom = {
        "none": None,
        "plain": {"Scale": Scale, "Regressor": Regressor},
        "package": {"nb>Scale": Scale, "Regressor": Regressor},
    }[mode]
    keras.utils.set_random_seed(0)
    model = Regressor()
    model(np.zeros((1, 3), dtype="float32"))
    est = KerasEstimator(
        num_proc=2,
        store=LocalStore(store_dir),
        model=model,
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        verbose=0,
        custom_objects=custom,
        run_id=f"main_{mode}",
    )
    fitted = est.fit(df)
    net = fitted.getModel()
    probe = x[:4].astype("float32")
    want = net.predict(probe, verbose=0).reshape(-1).tolist()
    scored = fitted.transform(df.limit(4)).collect()
    got = [r["y__output"] for r in scored]
    rows = np.array([r["features"].toArray() for r in scored], dtype="float32")
    want_rows = net.predict(rows, verbose=0).reshape(-1).tolist()
    path = os.path.join(store_dir, "saved_model")
    fitted.write().overwrite().save(path)
    loaded = KerasModel.load(path)
    reloaded = loaded.getModel().predict(probe, verbose=0).reshape(-1).tolist()
    keras_path = os.path.join(store_dir, "model.keras")
    net.save(keras_path)
    # A plain .keras file of the trained model loads with the objects the Spark model carries.
    plain_model = keras.saving.load_model(keras_path, custom_objects=loaded.getCustomObjects())
    plain = plain_model.predict(probe, verbose=0).reshape(-1).tolist()
    print(
        "RESULT "
        + json.dumps(
            {
                "want": want,
                "transform": got,
                "want_rows": want_rows,
                "reloaded": reloaded,
                "keras_file": plain,
                "losses": [h["loss"] for h in fitted.getHistory()],
                "classes": [type(net).__name__, type(net.scale).__name__],
            }
        ),
        flush=True,
    )
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
