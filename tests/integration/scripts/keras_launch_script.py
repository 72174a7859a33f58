"""A horovod.tensorflow.keras training script; only the import differs from Horovod's.

Run: ``python -m spark_estimators.launch -np 2 tests/integration/scripts/keras_launch_script.py``.
Each rank prints one ``RESULT {json}`` line: its rank, the epoch losses and a hash of its
final weights (identical on every rank when training is correctly synchronised).
"""

import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_estimators.collective.keras as hvd  # was: import horovod.tensorflow.keras as hvd

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)

rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.5).astype("float32")
# Each rank trains on its own shard, as in Horovod's examples.
dataset = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .shard(hvd.size(), hvd.rank())
    .shuffle(512, seed=hvd.rank())
    .batch(32)
)

keras.utils.set_random_seed(hvd.rank())  # different on purpose: the broadcast must fix it
model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
)
# Horovod: scale the learning rate by the number of workers.
opt = keras.optimizers.Adam(0.005 * hvd.size())
opt = hvd.DistributedOptimizer(opt)
model.compile(optimizer=opt, loss="mse", metrics=["mae"], jit_compile=False)

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.005 * hvd.size(), warmup_epochs=2),
]
history = model.fit(dataset, epochs=6, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()
print(
    "RESULT "
    + json.dumps(
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "loss": history.history["loss"],
            "lr": history.history["lr"],
            "weights": digest,
        }
    ),
    flush=True,
)
