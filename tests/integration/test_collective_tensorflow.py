"""The TensorFlow adapter (``spark_estimators.collective.tensorflow``) on 2 real processes.

One suite function runs in both ranks per backend (Gloo, and MPI when mpi4py is installed)
and records what it saw; the tests check the values against numpy computed here: the ops
eagerly and inside ``tf.function``, their gradients, fp16 compression, Adasum, process sets,
``DistributedGradientTape`` (dense, ``IndexedSlices`` allgathered or made dense, local
sources), ``broadcast_variables`` and elastic state. A custom TF2 loop on 2 ranks x 16 rows
ends with the weights of one process on the 32 rows.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

BACKENDS = ["gloo"] + (["mpi"] if importlib.util.find_spec("mpi4py") else [])
STEPS = 5


def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).reshape(-1, 1)
    return x, y


def _model(tf):
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])  # fmt: skip
    return model


def _train(hvd, tf, x, y, rank_seeded: bool):
    """A custom TF2 loop: DistributedGradientTape in tf.function, broadcast after step 1."""
    import keras

    model = _model(tf)
    if rank_seeded:  # different initial weights per rank: the broadcast must fix them
        for v in model.trainable_variables:
            v.assign(v + float(hvd.rank()))
    opt = keras.optimizers.SGD(0.05)

    @tf.function
    def step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    if rank_seeded:
        # Horovod's pattern broadcasts after the first step; start from rank 0's weights too.
        hvd.broadcast_variables(model.variables, root_rank=0)
    for i in range(STEPS):
        step(tf.constant(x), tf.constant(y), i == 0)
    return [v.numpy() for v in model.trainable_variables]


def _suite() -> dict:  # noqa: PLR0915 - one process pair runs every check
    import tensorflow as tf

    import spark_estimators.collective.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    topology_ops = (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op())
    out: dict = {"rank": r, "size": n, "ops": [int(x.numpy()) for x in topology_ops]}
    base = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r
    t = tf.constant(base)
    for op in ("Average", "Sum", "Min", "Max", "Product"):
        out[f"eager_{op}"] = hvd.allreduce(t, op=getattr(hvd, op)).numpy()
    out["variable"] = hvd.allreduce(tf.Variable(base), op=hvd.Sum).numpy()
    out["int_avg"] = hvd.allreduce(tf.constant([3, 4], tf.int32) + r).numpy()
    half = hvd.allreduce(t, compression=hvd.Compression.fp16, op=hvd.Sum)
    out["fp16"], out["fp16_dtype"] = half.numpy(), half.dtype.name
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy()
    mixed = [t, tf.constant([r], tf.int64), tf.constant(1.0 + r, tf.float64)]
    grouped = hvd.grouped_allreduce(mixed, op=hvd.Sum)
    out["grouped"] = [g.numpy() for g in grouped]
    # Adasum of orthogonal vectors is their sum, of equal ones the vector itself.
    out["adasum_orth"] = hvd.allreduce(tf.constant([1.0, 0.0] if r == 0 else [0.0, 2.0],
                                       tf.float64), op=hvd.Adasum).numpy()  # fmt: skip
    out["adasum_same"] = hvd.allreduce(tf.constant([3.0, 4.0], tf.float64), op=hvd.Adasum).numpy()

    @tf.function
    def graph_ops(x):
        g = hvd.allgather(x[: r + 1])
        b = hvd.broadcast(x, root_rank=1)
        a, received = hvd.alltoall(tf.range(3) + 10 * r, splits=[1, 2])
        s = hvd.reducescatter(x, op=hvd.Sum)
        return hvd.allreduce(x, op=hvd.Sum), g, b, a, received, s

    out["graph"] = [v.numpy() for v in graph_ops(t)]
    out["graph_retraced_same"] = [v.numpy() for v in graph_ops(t)][0]
    var = tf.Variable([float(r)] * 3)
    out["broadcast_"] = [v.numpy() for v in hvd.broadcast_([var], root_rank=1)] + [var.numpy()]

    # Gradients (horovod's): allreduce Sum -> size * dy; allgather -> this rank's block of the
    # averaged gradient; broadcast -> averaged on the root, zero elsewhere.
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as tape:
        s = tf.reduce_sum(hvd.allreduce(w * (r + 1), op=hvd.Sum))
        g = tf.reduce_sum(hvd.allgather(w) * tf.constant([1.0, 1.0, 2.0, 2.0]))
        b = tf.reduce_sum(hvd.broadcast(w, root_rank=0))
    out["grad_allreduce"] = tape.gradient(s, w).numpy()
    out["grad_allgather"] = tape.gradient(g, w).numpy()
    out["grad_broadcast"] = tape.gradient(b, w).numpy()

    # DistributedGradientTape: dense, IndexedSlices (allgathered / sparse_as_dense), local.
    emb = tf.Variable(np.ones((4, 2), np.float32))
    dense = tf.Variable([1.0, 1.0])
    local = tf.Variable([1.0])
    ids = tf.constant([r, 2])

    def tape_grads(**kwargs):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(tf.gather(emb, ids)) + tf.reduce_sum(dense * dense)
            loss = (total + tf.reduce_sum(local)) * (r + 1)
        dtape = hvd.DistributedGradientTape(tape, **kwargs)
        dtape.register_local_source(local)
        return dtape.gradient(loss, [emb, dense, local])

    sparse = tape_grads()
    out["tape_sparse_type"] = type(sparse[0]).__name__
    out["tape_sparse"] = tf.convert_to_tensor(sparse[0]).numpy()
    out["tape_dense"] = [tf.convert_to_tensor(x).numpy() for x in tape_grads(sparse_as_dense=True)]
    out["tape_dense_type"] = type(tape_grads(sparse_as_dense=True)[0]).__name__
    out["tape_fn"] = [v.numpy() for v in tf.function(lambda: tape_grads(sparse_as_dense=True))()]
    out["tape_fp16"] = tf.convert_to_tensor(
        tape_grads(sparse_as_dense=True, compression=hvd.Compression.fp16)[1]
    ).numpy()

    # Process sets: a set of both ranks equals the global op; a rank outside a set gets
    # InvalidArgumentError; the tape trains locally outside its set.
    both = hvd.add_process_set([0, 1])
    only0 = hvd.add_process_set([0])
    out["ps_both"] = hvd.allreduce(t, op=hvd.Sum, process_set=both).numpy()
    if r == 0:
        out["ps_only0"] = hvd.allreduce(t, op=hvd.Sum, process_set=only0).numpy()
    else:
        try:
            hvd.allreduce(t, process_set=only0)
        except tf.errors.InvalidArgumentError as exc:
            out["ps_outside"] = str(exc)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense * dense) * (r + 1)
    out["ps_tape"] = (
        hvd.DistributedGradientTape(tape, process_set=only0).gradient(loss, [dense])[0].numpy()
    )
    hvd.barrier()

    # A mismatch fails on every rank with TensorFlow's error type and ours.
    try:
        hvd.allreduce(tf.ones([r + 1]), name="mismatch")
    except tf.errors.FailedPreconditionError as exc:
        from spark_estimators.errors import CollectiveError

        out["mismatch"] = (isinstance(exc, CollectiveError), str(exc))

    out["objects"] = (hvd.broadcast_object({"r": r}, root_rank=1), hvd.allgather_object(r))

    # Elastic state of a Keras model and optimizer: sync to rank 0, restore, commit.
    import keras

    model = _model(tf)
    for v in model.trainable_variables:
        v.assign(tf.fill(v.shape, float(r)))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=5 + r)
    state.sync()
    out["elastic_sync"] = (float(model.trainable_variables[0].numpy().sum()), state.epoch)
    model.trainable_variables[0].assign(tf.fill(model.trainable_variables[0].shape, 7.0))
    state.epoch = 9
    state.restore()
    out["elastic_restore"] = (float(model.trainable_variables[0].numpy().sum()), state.epoch)

    x, y = _data()
    half_rows = slice(16 * r, 16 * (r + 1))
    out["trained"] = _train(hvd, tf, x[half_rows], y[half_rows], rank_seeded=True)
    out["join"] = int(hvd.join().numpy())
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def suite(request):
    return run_local(_suite, num_proc=2, backend=request.param)


def _each(suite, key):
    return [s[key] for s in suite]


def _base(r: int) -> np.ndarray:
    return np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r


def test_reductions_eager_match_numpy(suite):
    a, b = _base(0), _base(1)
    expected = {"Average": (a + b) / 2, "Sum": a + b, "Min": np.minimum(a, b),
                "Max": np.maximum(a, b), "Product": a * b}  # fmt: skip
    for s in suite:
        assert s["ops"] == [s["rank"], 2, s["rank"], 2]
        for op, want in expected.items():
            np.testing.assert_allclose(s[f"eager_{op}"], want, err_msg=op)
        np.testing.assert_allclose(s["variable"], a + b)
        np.testing.assert_array_equal(s["int_avg"], [3, 4])  # (3+4)/2 truncated, (4+5)/2
        assert s["fp16_dtype"] == "float32"
        np.testing.assert_allclose(s["fp16"], a + b, rtol=1e-3)
        np.testing.assert_allclose(s["scaled"], a + b)
        np.testing.assert_allclose(s["grouped"][0], a + b)
        assert s["grouped"][1].tolist() == [1] and s["grouped"][2] == 3.0
        np.testing.assert_allclose(s["adasum_orth"], [1.0, 2.0])
        np.testing.assert_allclose(s["adasum_same"], [3.0, 4.0])


def test_ops_inside_tf_function(suite):
    a, b = _base(0), _base(1)
    for s in suite:
        summed, gathered, bcast, a2a, received, scattered = s["graph"]
        np.testing.assert_allclose(summed, a + b)
        np.testing.assert_allclose(s["graph_retraced_same"], a + b)
        np.testing.assert_allclose(gathered, np.concatenate([a[:1], b[:2]]))
        np.testing.assert_allclose(bcast, b)
        np.testing.assert_allclose(scattered, (a + b)[s["rank"] : s["rank"] + 1])
    assert suite[0]["graph"][3].tolist() == [0, 10] and suite[0]["graph"][4].tolist() == [1, 1]
    assert suite[1]["graph"][3].tolist() == [1, 2, 11, 12]
    assert suite[1]["graph"][4].tolist() == [2, 2]
    for s in suite:
        assert [x.tolist() for x in s["broadcast_"]] == [[1.0] * 3, [1.0] * 3]


def test_gradients_follow_horovod(suite):
    for s in suite:
        np.testing.assert_allclose(s["grad_allreduce"], [2.0 * (s["rank"] + 1)] * 2)
        # d/dw of sum(allgather(w) * [1,1,2,2]): the average over ranks of that rank's block
        np.testing.assert_allclose(s["grad_allgather"], [1.0 + s["rank"]] * 2)
        np.testing.assert_allclose(s["grad_broadcast"], [1.0, 1.0] if s["rank"] == 0 else [0, 0])


def test_distributed_gradient_tape(suite):
    # Per-rank gradients: emb rows [r, 2] get (r+1); dense 2*(r+1); averaged over 2 ranks.
    emb = np.zeros((4, 2), np.float32)
    for r in (0, 1):
        emb[r] += (r + 1) / 2
        emb[2] += (r + 1) / 2
    for s in suite:
        assert s["tape_sparse_type"] == "IndexedSlices"
        assert s["tape_dense_type"] != "IndexedSlices"
        np.testing.assert_allclose(s["tape_sparse"], emb)
        for grads in (s["tape_dense"], s["tape_fn"]):
            np.testing.assert_allclose(grads[0], emb)
            np.testing.assert_allclose(grads[1], [3.0, 3.0])  # mean of 2*1 and 2*2
            np.testing.assert_allclose(grads[2], [(s["rank"] + 1) / 2])  # local, / size
        np.testing.assert_allclose(s["tape_fp16"], [3.0, 3.0], rtol=1e-3)


def test_process_sets(suite):
    a, b = _base(0), _base(1)
    for s in suite:
        np.testing.assert_allclose(s["ps_both"], a + b)
    np.testing.assert_allclose(suite[0]["ps_only0"], a)
    assert "not a member" in suite[1]["ps_outside"]
    np.testing.assert_allclose(suite[0]["ps_tape"], [2.0, 2.0])  # a set of one: its own
    np.testing.assert_allclose(suite[1]["ps_tape"], [4.0, 4.0])  # outside: trains locally


def test_errors_objects_join_and_elastic(suite):
    for s in suite:
        is_ours, message = s["mismatch"]
        assert is_ours and "mismatch" in message
        assert s["objects"] == ({"r": 1}, [0, 1])
        assert s["join"] in (0, 1)
        # rank 0's weights (all zeros) and epoch after sync; restore goes back to them
        assert s["elastic_sync"] == (0.0, 5)
        assert s["elastic_restore"] == (0.0, 5)
    assert suite[0]["join"] == suite[1]["join"]


def _single() -> list:
    import tensorflow as tf

    import spark_estimators.collective.tensorflow as hvd

    hvd.init()  # one rank: the tape and the broadcasts leave everything as it is
    x, y = _data()
    return _train(hvd, tf, x, y, rank_seeded=False)


def test_custom_loop_matches_one_process(suite):
    (single,) = run_local(_single, num_proc=1, backend="gloo")
    for s in suite:
        for got, want in zip(s["trained"], single, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got0, got1 in zip(suite[0]["trained"], suite[1]["trained"], strict=True):
        np.testing.assert_array_equal(got0, got1)
