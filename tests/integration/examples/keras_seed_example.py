"""Horovod's KerasEstimator example ("Horovod on Spark" in the seed docs), ported by imports.

The estimator call, the model, the optimizer, the loss and the transform are the seed's. What
differs, and why (none of it is our API):

- imports: ``horovod.spark.keras`` -> ``spark_estimators.keras``, ``HDFSStore`` ->
  ``spark_estimators.store.Store``;
- the seed chains ``Sequential()`` and ``.add(...)`` over indented lines, which is not valid Python
  (``add`` returns None): one ``model.add(...)`` per line;
- Keras 3 removed the ``lr`` alias: ``SGD(lr=0.1)`` raises, ``SGD(learning_rate=0.1)`` is the
  same optimizer;
- no HDFS here: the store is a local directory; the seed leaves ``train_df``/``test_df`` to the
  reader: a two-feature vector column ``features`` and a binary label ``y`` are made below.

Run: ``python tests/integration/examples/keras_seed_example.py`` (num_proc=4 as in the seed, on a
``local[4]`` session). Prints one JSON line with the results; exits non-zero if a check fails.
"""

import json
import tempfile

import numpy as np
import tensorflow as tf  # noqa: F401 - as in the seed
from tensorflow import keras

import spark_estimators.keras as hvd  # was: import horovod.spark.keras as hvd
from spark_estimators.core.session import create_local_session
from spark_estimators.store import Store  # was: HDFSStore


def make_data(spark, n, seed):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2))
    y = (x[:, 0] + 2 * x[:, 1] > 0).astype(float)
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(n)]
    return spark.createDataFrame(rows, ["features", "y"])


spark = create_local_session("local[4]")
spark.sparkContext.setLogLevel("ERROR")
train_df, test_df = make_data(spark, 1024, 0), make_data(spark, 256, 1)

# ---- the seed's example -------------------------------------------------------------------------
model = keras.models.Sequential()
model.add(keras.layers.Dense(8, input_dim=2))
model.add(keras.layers.Activation("tanh"))
model.add(keras.layers.Dense(1))
model.add(keras.layers.Activation("sigmoid"))

# NOTE: unscaled learning rate
optimizer = keras.optimizers.SGD(learning_rate=0.1)
loss = "binary_crossentropy"

store = Store.create(tempfile.mkdtemp(prefix="keras-seed-store-"))
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


keras_model = keras_estimator.fit(train_df).setOutputCols(["predict"])
predict_df = keras_model.transform(test_df)

# "extract the underlying Keras model and use it outside of Spark"
model = keras_model.getModel()
pred = model.predict([np.ones([1, 2], dtype=np.float32)])
# ---- end of the seed's example ------------------------------------------------------------------

rows = predict_df.select("y", "predict").collect()
accuracy = float(np.mean([(r["predict"] > 0.5) == (r["y"] > 0.5) for r in rows]))
history = keras_model.getHistory()
result = {
    "epochs": [h["epoch"] for h in history],
    "first_loss": history[0]["loss"],
    "last_loss": history[-1]["loss"],
    "test_accuracy": accuracy,
    "pred_ones": float(np.asarray(pred).ravel()[0]),
    "pred_shape": list(np.asarray(pred).shape),
}
print("RESULT " + json.dumps(result))
spark.stop()
assert result["last_loss"] < 0.5 * result["first_loss"], result
assert accuracy > 0.9, result
