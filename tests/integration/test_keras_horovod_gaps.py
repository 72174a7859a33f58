"""Horovod's Keras API gaps (issue 44): the broadcast callback, partial and elastic pieces.

Item 1: a ``Sequential`` without an ``Input``, a subclassed ``keras.Model`` and a model
with its own ``train_step`` failed on the first step ("Unknown variable ... This optimizer can only
be called for the variables it was originally built with"): the callback built the optimizer for
a model that had no variables yet. Horovod broadcasts after the first batch in that case; so do
we. Each rank starts from its own random weights, and the ranks must end equal.

Item 2: ``PartialDistributedOptimizer(local_layers=...)``, ``hvd.elastic.KerasState`` and its
callbacks, ``BroadcastGlobalVariablesCallback(local_variables=...)``.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytest.importorskip("keras")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _fit(kind: str) -> dict:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    import spark_estimators.collective.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(100 + hvd.rank())  # different initial weights per rank

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.d1 = keras.layers.Dense(8, activation="relu")
            self.d2 = keras.layers.Dense(1)

        def call(self, x):
            return self.d2(self.d1(x))

    class OwnStep(Sub):
        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    local_bias = None
    if kind == "sequential":
        model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    elif kind == "subclassed":
        model = Sub()
    elif kind == "own_train_step":
        model = OwnStep()
    else:  # built up front, one variable kept local
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        local_bias = model.layers[-1].kernel  # initialised per rank
    rng = np.random.RandomState(0)
    x = rng.rand(64, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local_bias)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    shared = [v for v in model.weights if local_bias is None or v is not local_bias]
    return {
        "weights": np.concatenate([np.asarray(v.numpy()).ravel() for v in shared]).tolist(),
        "local": None if local_bias is None else np.asarray(local_bias.numpy()).tolist(),
        "loss": history.history["loss"],
    }


@pytest.mark.parametrize(
    "kind",
    [
        "sequential",
        pytest.param("subclassed", marks=pytest.mark.slow),
        pytest.param("own_train_step", marks=pytest.mark.slow),
    ],
)
def test_models_built_in_their_first_step_end_equal_on_every_rank(kind: str) -> None:
    results = run_local(_fit, num_proc=2, args=(kind,), backend="gloo")
    zero, one = results
    assert isinstance(zero, dict) and isinstance(one, dict), results
    assert zero["weights"] == one["weights"]  # bit for bit: broadcast, then averaged steps
    assert len(zero["loss"]) == 2
    if kind != "own_train_step":  # its train_step reports no compiled loss
        assert zero["loss"][1] < zero["loss"][0]


def test_local_variables_stay_each_ranks_own() -> None:
    zero, one = run_local(_fit, num_proc=2, args=("local",), backend="gloo")
    assert isinstance(zero, dict) and isinstance(one, dict)
    assert zero["weights"] == one["weights"]
    assert zero["local"] != one["local"]  # not broadcast: each rank keeps its own kernel


def _partial() -> dict:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np
    import tensorflow as tf

    import spark_estimators.collective.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(7)  # the same initial weights on both ranks
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="shared"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    head = model.get_layer("head")
    rng = np.random.RandomState(hvd.rank())  # different rows per rank
    x = rng.rand(8, 4).astype("float32")
    y = rng.rand(8, 1).astype("float32")
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
    own_grad = tape.gradient(loss, head.kernel).numpy()
    before = head.kernel.numpy().copy()
    lr = 0.1
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[head])
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.train_on_batch(x, y)
    expected_head = before - lr * own_grad / hvd.size()
    return {
        "shared": model.get_layer("shared").kernel.numpy().ravel().tolist(),
        "head": head.kernel.numpy().ravel().tolist(),
        "head_error": float(np.abs(head.kernel.numpy() - expected_head).max()),
    }


def test_partial_distributed_optimizer_keeps_local_layers_local() -> None:
    zero, one = run_local(_partial, num_proc=2, backend="gloo")
    assert isinstance(zero, dict) and isinstance(one, dict), (zero, one)
    assert zero["shared"] == one["shared"]  # averaged gradients: equal updates
    assert zero["head"] != one["head"]  # each rank's own gradient
    assert zero["head_error"] < 1e-6 and one["head_error"] < 1e-6  # own gradient / size


def _elastic_state() -> dict:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    import spark_estimators.collective.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)  # fmt: skip
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()  # rank 0's weights everywhere
    commits = []
    real_commit = state.commit

    def counting_commit() -> None:
        commits.append((state.epoch, state.batch))
        real_commit()

    state.commit = counting_commit  # type: ignore[method-assign]
    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    callbacks = [
        hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
    ]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    committed = [np.array(v) for v in model.get_weights()]
    after_fit = (state.epoch, state.batch)
    for v in model.trainable_variables:
        v.assign(v + 1.0)
    state.restore()
    restored = all(
        np.array_equal(a, b) for a, b in zip(committed, model.get_weights(), strict=True)
    )
    return {
        "after_fit": after_fit,
        "commits": len(commits),
        "restored": restored,
        "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist(),
    }


def test_keras_state_and_its_callbacks_follow_fit() -> None:
    zero, one = run_local(_elastic_state, num_proc=2, backend="gloo")
    assert isinstance(zero, dict) and isinstance(one, dict), (zero, one)
    assert tuple(zero["after_fit"]) == (2, 0)
    assert zero["commits"] == 2 * (2 + 1)  # 4 batches an epoch: 2 by count + 1 at its end
    assert zero["restored"] and one["restored"]
    assert zero["weights"] == one["weights"]  # synced from rank 0, then averaged steps


def _process_set_optimizer() -> dict:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import spark_estimators.collective.keras as hvd

    first_two = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[first_two])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=first_two)
    var = keras.Variable([0.0])
    opt.apply_gradients([(tf.constant([float(hvd.rank() + 1)]), var)])
    return {"included": bool(first_two.included()), "value": float(var.numpy()[0])}


@pytest.mark.slow  # 3 TensorFlow ranks, ~1 min; make test-conformance runs horovod's test of it
def test_distributed_optimizer_outside_its_process_set_applies_the_ranks_own_gradient() -> None:
    # horovod's test_tensorflow2_keras_process_sets.py: the members average, a rank outside the
    # set steps with its own gradient (this rank used to fail: "not a member of the process set").
    out = run_local(_process_set_optimizer, num_proc=3, backend="gloo")
    assert out[0] == out[1] == {"included": True, "value": -1.5}  # -(1 + 2) / 2
    assert out[2] == {"included": False, "value": -3.0}  # its own gradient, 3
