"""The seed's "Training on existing Parquet datasets" examples, ported by changing imports.

Seed: 003_*.txt, "Horovod on Spark" > "Training on existing Parquet datasets": the
``fit_on_parquet()`` example on a store with ``train_path``/``val_path``, the "extract the
underlying Keras model" example (``getModel()`` + ``predict``) and the ``util.prepare_data``
example. ``model``, ``optimizer`` and ``loss`` are the ones of the seed's KerasEstimator example
(see keras_seed_example.py) which these examples continue.

Changed lines (imports only):

- ``import horovod.spark.keras as hvd`` -> ``import spark_estimators.keras as hvd``
- ``HDFSStore`` (horovod.spark.common.store) -> ``from spark_estimators.store import LocalStore
  as HDFSStore``: no HDFS here, the same paths are directories under a temporary root
  (``/user/username/...`` -> ``<tmp>/user/username/...``, the one value changed in the calls)
- ``from horovod.spark.common import util`` -> ``from spark_estimators.data import horovod_util
  as util``

Not the seed's code (it leaves them to the reader): the Spark session, the Parquet "already" at
``train_path``/``val_path`` (written here by Spark: ``features`` as array<float> of 2, ``y`` a
0/1 double; the seed requires no Spark vector types in such files) and the DataFrame ``df`` of
the prepare_data example (``features`` an ML vector, ``y``), plus the checks at the end. The
seed's chained ``Sequential().add(...)`` is not valid Python: one ``model.add`` per line, and
Keras 3 spells ``SGD(lr=...)`` as ``SGD(learning_rate=...)`` (as in keras_seed_example.py).

Run: ``python tests/integration/examples/seed_keras_parquet.py`` (num_proc=4 as in the seed, on
a ``local[4]`` session). Prints one ``RESULT {json}`` line.
"""

import json
import os
import tempfile

import numpy as np
import tensorflow as tf  # noqa: F401 - as in the seed
from tensorflow import keras

import spark_estimators.keras as hvd  # was: import horovod.spark.keras as hvd
from spark_estimators.core.session import create_local_session
from spark_estimators.data import horovod_util as util  # was: from horovod.spark.common import util
from spark_estimators.store import LocalStore as HDFSStore  # was: horovod's HDFSStore

ROOT = tempfile.mkdtemp(prefix="seed-parquet-")  # stands for HDFS's root


def rows(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2))
    y = (x[:, 0] + 2 * x[:, 1] > 0).astype(float)
    return x, y


def existing_parquet(spark, path, n, seed):
    """Parquet written by someone else: plain arrays, no Spark vector type."""
    x, y = rows(n, seed)
    data = [([float(v) for v in x[i]], float(y[i])) for i in range(n)]
    spark.createDataFrame(data, "features array<float>, y double").write.parquet(path)


def vector_df(spark, n, seed):
    from pyspark.ml.linalg import Vectors

    x, y = rows(n, seed)
    data = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(n)]
    return spark.createDataFrame(data, ["features", "y"])


spark = create_local_session("local[4]")
spark.sparkContext.setLogLevel("ERROR")
existing_parquet(spark, ROOT + "/user/username/training_dataset", 1024, 0)
existing_parquet(spark, ROOT + "/user/username/val_dataset", 256, 1)
df = vector_df(spark, 1024, 2)

# ---- the seed's KerasEstimator example: model, optimizer, loss --------------------------------
model = keras.models.Sequential()
model.add(keras.layers.Dense(8, input_dim=2))
model.add(keras.layers.Activation("tanh"))
model.add(keras.layers.Dense(1))
model.add(keras.layers.Activation("sigmoid"))

# NOTE: unscaled learning rate
optimizer = keras.optimizers.SGD(learning_rate=0.1)
loss = "binary_crossentropy"

# ---- the seed: "Training on existing Parquet datasets" ----------------------------------------
store = HDFSStore(
    train_path=ROOT + "/user/username/training_dataset",
    val_path=ROOT + "/user/username/val_dataset",
)
keras_estimator = hvd.KerasEstimator(
    num_proc=4,
    store=store,
    model=model,
    optimizer=optimizer,
    loss=loss,
    feature_cols=["features"],
    label_cols=["y"],
    batch_size=32,
    epochs=10,
)

keras_model = keras_estimator.fit_on_parquet()

model = keras_model.getModel()
pred = model.predict([np.ones([1, 2], dtype=np.float32)])

parquet_history = keras_model.getHistory()
ones_prediction = float(np.asarray(pred).ravel()[0])
parquet_model = keras_model

# ---- the seed: prepare_data, then fit_on_parquet ----------------------------------------------
store = HDFSStore(
    train_path=ROOT + "/user/username/training_dataset",
    val_path=ROOT + "/user/username/val_dataset",
)
with util.prepare_data(
    num_processes=4,
    store=store,
    df=df,
    feature_columns=["features"],
    label_columns=["y"],
    validation=0.1,
    compress_sparse=True,
):
    keras_estimator = hvd.KerasEstimator(
        num_proc=4,
        store=store,
        model=model,
        optimizer=optimizer,
        loss=loss,
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=10,
    )

    keras_model = keras_estimator.fit_on_parquet()
# ---- end of the seed's examples ---------------------------------------------------------------

prepared_history = keras_model.getHistory()
predict_df = keras_model.setOutputCols(["predict"]).transform(vector_df(spark, 256, 3))
scored = predict_df.select("y", "predict").collect()
accuracy = float(np.mean([(r["predict"] > 0.5) == (r["y"] > 0.5) for r in scored]))
result = {
    "parquet_epochs": len(parquet_history),
    "parquet_first_loss": parquet_history[0]["loss"],
    "parquet_last_loss": parquet_history[-1]["loss"],
    "parquet_val_loss": parquet_history[-1].get("val_loss"),
    "pred_shape": list(np.asarray(pred).shape),
    "pred_ones": ones_prediction,
    "runs_dir": sorted(os.listdir(ROOT + "/user/username/runs")),
    "datasets": store.list_datasets(),
    "prepared_epochs": len(prepared_history),
    "prepared_last_loss": prepared_history[-1]["loss"],
    "prepared_val_loss": prepared_history[-1].get("val_loss"),
    "test_accuracy": accuracy,
}
print("RESULT " + json.dumps(result))
spark.stop()
