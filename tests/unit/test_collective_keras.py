"""spark_estimators.collective.keras: DistributedOptimizer, callbacks and ops in real processes.

One 2-process launch runs every multi-rank check (TensorFlow costs seconds per process); each rank
also trains the single-process reference on the concatenated 2B batches itself, so
"2 ranks x B == 1 process x 2B" needs no second launch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from spark_estimators.launch import run_local  # noqa: E402

SIZE = 2
BATCH = 8
STEPS = 6
FEATURES = 4


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SIZE * BATCH * STEPS, FEATURES)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32") + 0.3)[:, None]
    return x, y


def _shard(a, rank):
    """Rank r's rows of each global batch of SIZE * BATCH rows."""
    gb = SIZE * BATCH
    return np.concatenate(
        [a[i * gb : (i + 1) * gb][rank * BATCH : (rank + 1) * BATCH] for i in range(STEPS)]
    )


def _mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def _weights(model):
    return [w.numpy().copy() for w in model.weights]


def _two_rank_checks(tmp_dir):
    import tensorflow as tf

    import spark_estimators.collective.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank = hvd.rank()
    out = {"rank": rank, "size": hvd.size()}
    x, y = _data()
    xs, ys = _shard(x, rank), _shard(y, rank)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]

    # 1. Averaged gradients == one process on the 2B batch, for two optimizers.
    for name, make_opt, kwargs in (
        ("sgd", lambda: keras.optimizers.SGD(0.02, momentum=0.5), {}),
        ("adam_predivide", lambda: keras.optimizers.Adam(0.01), {"gradient_predivide_factor": 2.0}),
    ):
        model = _mlp(1)
        model.compile(
            hvd.DistributedOptimizer(make_opt(), **kwargs),
            "mse",
            metrics=["mae"],
            jit_compile=False,
        )
        hist = model.fit(
            xs, ys, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=cbs
        )
        ref = _mlp(1)
        ref.compile(make_opt(), "mse", jit_compile=False)
        ref.fit(x, y, batch_size=SIZE * BATCH, epochs=2, shuffle=False, verbose=0)
        out[name] = {
            "weights": _weights(model),
            "ref": _weights(ref),
            "history": hist.history,
            "optimizer_class": type(model.optimizer).__mro__[2].__name__,
        }

    # 2. Different initial weights per rank: the broadcast makes rank 0's win.
    model = _mlp(100 + rank)
    out["init"] = _weights(model)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse", jit_compile=False)
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, callbacks=cbs)
    out["after_broadcast"] = _weights(model)

    # 3. One rank asks to stop: both stop after that epoch.
    class StopOnRankOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if rank == 1:
                self.model.stop_training = True

    hist = model.fit(
        xs,
        ys,
        batch_size=BATCH,
        epochs=4,
        verbose=0,
        callbacks=[*cbs, StopOnRankOne(), hvd.callbacks.StopTrainingAgreement()],
    )
    out["stopped_epochs"] = len(hist.history["loss"])

    # 4. EarlyStopping after MetricAverageCallback sees the same (averaged) loss on every rank.
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    hist = model.fit(xs, ys, batch_size=BATCH, epochs=5, verbose=0, callbacks=[*cbs, early])
    out["early_epochs"] = len(hist.history["loss"])
    out["early_losses"] = hist.history["loss"]

    # 5. Learning-rate warmup from lr/size to lr over 2 epochs.
    model = _mlp(1)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=False)
    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    hist = model.fit(xs, ys, batch_size=BATCH, epochs=3, verbose=0, callbacks=[*cbs, warm])
    out["warmup_lr"] = hist.history["lr"]

    # 6. fp16 compression stays close to the reference.
    model = _mlp(1)
    model.compile(
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=hvd.Compression.fp16),
        "mse",
        jit_compile=False,
    )
    model.fit(xs, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=cbs)
    ref = _mlp(1)
    ref.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    ref.fit(x, y, batch_size=SIZE * BATCH, epochs=1, shuffle=False, verbose=0)
    out["fp16_max_diff"] = max(
        float(np.abs(a - b).max()) for a, b in zip(_weights(model), _weights(ref))
    )

    # 7. Eager ops on tensors and numpy.
    out["allreduce"] = float(hvd.allreduce(tf.constant([float(rank)]))[0])
    out["allreduce_sum"] = hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum).tolist()
    out["allgather"] = hvd.allgather(tf.constant([[rank]] * (rank + 1))).numpy().ravel().tolist()
    out["broadcast"] = hvd.broadcast(tf.constant([10.0 + rank]), root_rank=1).numpy().tolist()
    out["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=0)
    out["average_logs"] = hvd.callbacks.average_logs({"v": float(rank), "name": "x"})

    # 8. A checkpoint saved with the distributed optimizer; hvd.load_model re-wraps it.
    path = os.path.join(tmp_dir, f"model_{rank}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    out["loaded_is_distributed"] = hvd.is_distributed_optimizer(loaded.optimizer)
    loaded.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, callbacks=cbs)
    out["loaded_weights"] = _weights(loaded)
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("keras-collective"))
    return run_local(_two_rank_checks, SIZE, args=(tmp,), env={"TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sgd", "adam_predivide"])
def test_two_ranks_of_b_equal_one_process_of_2b(ranks, name):
    r0, r1 = ranks[0][name], ranks[1][name]
    for a, b in zip(r0["weights"], r1["weights"]):
        np.testing.assert_array_equal(a, b)  # ranks bitwise identical
    for a, ref in zip(r0["weights"], r0["ref"]):
        np.testing.assert_allclose(a, ref, rtol=0, atol=1e-5)
    # Weights moved: the comparison is not trivially between two untouched models.
    init = _weights(_mlp(1))
    assert max(float(np.abs(a - b).max()) for a, b in zip(r0["weights"], init)) > 1e-2
    # History holds the metrics averaged over the ranks: identical everywhere.
    assert r0["history"] == r1["history"]
    assert r0["history"]["loss"][1] < r0["history"]["loss"][0]
    assert r0["optimizer_class"] in ("SGD", "Adam")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_broadcast_makes_rank_zero_weights_win(ranks):
    r0, r1 = ranks
    assert any(not np.array_equal(a, b) for a, b in zip(r0["init"], r1["init"]))
    for a, b in zip(r0["after_broadcast"], r1["after_broadcast"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_stop_agreement_and_early_stopping_stop_every_rank_together(ranks):
    assert [r["stopped_epochs"] for r in ranks] == [1, 1]
    # min_delta is huge: epoch 1 never "improves", so EarlyStopping stops after epoch 1.
    assert [r["early_epochs"] for r in ranks] == [2, 2]
    assert ranks[0]["early_losses"] == ranks[1]["early_losses"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_learning_rate_warmup_reaches_initial_lr(ranks):
    lrs = ranks[0]["warmup_lr"]
    # Horovod's multiplier 1/size * (e * (size - 1) / warmup + 1); the last batch of epoch k
    # uses e = k + 1 (shifted by one batch), which is what the epoch's log shows.
    np.testing.assert_allclose(lrs[:2], [0.1 / SIZE * 1.5, 0.1], rtol=1e-5)
    assert lrs[0] < lrs[1] <= 0.1 + 1e-7
    np.testing.assert_allclose(lrs[2], 0.1, rtol=1e-6)  # unchanged after the warmup


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fp16_compression_and_eager_ops(ranks):
    r0, r1 = ranks
    assert 0 < r0["fp16_max_diff"] < 5e-3
    assert r0["allreduce"] == r1["allreduce"] == 0.5
    assert r0["allreduce_sum"] == [3.0]
    assert r0["allgather"] == r1["allgather"] == [0, 1, 1]
    assert r0["broadcast"] == r1["broadcast"] == [11.0]
    assert r1["broadcast_object"] == {"from": 0}
    assert r0["average_logs"] == r1["average_logs"] == {"v": 0.5, "name": "x"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_load_model_rewraps_the_optimizer(ranks):
    r0, r1 = ranks
    assert r0["loaded_is_distributed"] and r1["loaded_is_distributed"]
    for a, b in zip(r0["loaded_weights"], r1["loaded_weights"]):
        np.testing.assert_array_equal(a, b)


# -- single process ------------------------------------------------------------------------------
def test_saved_model_reloads_with_the_plain_optimizer(tmp_path):
    import spark_estimators.collective.keras as hvd

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model = _mlp(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(schedule))
    assert type(opt).__name__ == "Adam" and isinstance(opt, keras.optimizers.Adam)
    assert opt.learning_rate is not None and opt._learning_rate is schedule
    model.compile(opt, "mse", jit_compile=False)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # size 1: no collective needed
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert not hvd.is_distributed_optimizer(loaded.optimizer)
    np.testing.assert_array_equal(loaded.predict(x[:4], verbose=0), model.predict(x[:4], verbose=0))


def test_built_optimizer_keeps_its_state():
    import spark_estimators.collective.keras as hvd

    model = _mlp(0)
    plain = keras.optimizers.Adam(0.01)
    model.compile(plain, "mse", jit_compile=False)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    dist = hvd.DistributedOptimizer(plain)
    assert int(dist.iterations.numpy()) == int(plain.iterations.numpy()) > 0
    for a, b in zip(dist.variables, plain.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_mixed_precision_wraps_loss_scaling_inside():
    import spark_estimators.collective.keras as hvd

    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    finally:
        keras.config.set_dtype_policy(old)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert hvd.is_distributed_optimizer(opt)
    assert not hvd.is_distributed_optimizer(opt.inner_optimizer)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda hvd: hvd.DistributedOptimizer("sgd"), "needs a keras.optimizers.Optimizer"),
        (
            lambda hvd: hvd.DistributedOptimizer(
                keras.optimizers.SGD(), backward_passes_per_step=2
            ),
            "gradient_accumulation_steps=2",
        ),
        (
            lambda hvd: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum),
            "op=Adasum is not supported",
        ),
        (
            lambda hvd: hvd.DistributedOptimizer(
                keras.optimizers.LossScaleOptimizer(
                    hvd.DistributedOptimizer(keras.optimizers.SGD())
                )
            ),
            r"DistributedOptimizer\(LossScaleOptimizer\(opt\)\)",
        ),
        (
            lambda hvd: hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD())),
            "already a DistributedOptimizer",
        ),
    ],
)
def test_bad_arguments_are_explained(make, pattern):
    import spark_estimators.collective.keras as hvd
    from spark_estimators.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=pattern):
        make(hvd)


def test_fused_buffers_are_64_byte_aligned():
    from spark_estimators.collective.runtime.arrays import ALIGNMENT, aligned_empty

    for n, dtype in ((1, np.float32), (7, np.float64), (1000, np.float16), (33, np.float32)):
        buf = aligned_empty(n, dtype)
        assert buf.shape == (n,) and buf.dtype == np.dtype(dtype)
        assert buf.ctypes.data % ALIGNMENT == 0
    assert aligned_empty(0, np.float32).shape == (0,)
