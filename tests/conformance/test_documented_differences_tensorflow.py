"""Our documented behaviour where a ported horovod TensorFlow test expects horovod's.

The horovod tests of ``parallel/test_tensorflow.py`` and ``parallel/test_tensorflow2_keras.py``
that differ deliberately (listed in docs/conformance.md) carry an ``xfail`` naming this file;
these tests check what we do instead, as docs/tensorflow.md and docs/migration.md describe it.
They run 2 real ranks with the local launcher.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _errors_by_mode() -> dict:
    import tensorflow as tf

    import spark_estimators.collective.tensorflow as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    shape = [17 + hvd.rank()] * 2  # different shapes on the two ranks: a mismatch
    out = {}
    try:
        hvd.allreduce(tf.ones(shape))
    except tf.errors.OpError as exc:
        out["eager"] = (type(exc).__name__, isinstance(exc, tf.errors.FailedPreconditionError),
                        isinstance(exc, CollectiveError), "mismatched" in str(exc))  # fmt: skip

    @tf.function
    def reduce(x):
        return hvd.allreduce(x)

    try:
        reduce(tf.ones(shape))
    except tf.errors.OpError as exc:
        out["tf.function"] = (type(exc).__name__, "mismatched" in str(exc))
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        op = hvd.allreduce(tf.ones(shape))
        try:
            sess.run(op)
        except tf.errors.OpError as exc:
            out["graph"] = (type(exc).__name__, "mismatched" in str(exc))
    # the group is still usable: a mismatch exchanges nothing
    out["after"] = float(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy()[0])
    return out


def test_errors_of_failed_ops_in_graphs_are_unknown_error_with_the_message():
    # horovod's test_horovod_{allreduce,allgather,broadcast,alltoall,reducescatter}_*error in
    # graph mode expect FailedPreconditionError; a py_function's error is UnknownError.
    for result in run_local(_errors_by_mode, num_proc=2, backend="gloo"):
        assert result["eager"] == ("CollectiveFailedError", True, True, True)
        assert result["tf.function"] == ("UnknownError", True)
        assert result["graph"] == ("UnknownError", True)
        assert result["after"] == 2.0


def test_sync_batch_normalization_is_not_provided():
    # horovod's test_horovod_syncbn_cpu builds hvd.SyncBatchNormalization (a tf.keras 2 layer,
    # with Keras 2's fused=False on the reference layer). docs/tensorflow.md names the
    # alternatives (KerasEstimator(average_running_stats=True), hvd.allreduce of the moments).
    import spark_estimators.collective.tensorflow as hvd

    assert not hasattr(hvd, "SyncBatchNormalization")
    assert "SyncBatchNormalization" not in hvd.__all__


def _keras_optimizer_differences() -> dict:
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np
    import tensorflow as tf

    import spark_estimators.collective.keras as hvd
    from spark_estimators.errors import ConfigurationError

    hvd.init()
    out: dict = {}
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    except ConfigurationError as exc:
        out["bpps"] = str(exc)
    # what the message offers: Keras's own accumulation, then one averaged step of 2 passes
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2))
    var = keras.Variable([0.0])
    values = []
    for step in range(2):
        grad = tf.constant([float(hvd.rank() + 1) * (step + 1)])  # ranks 1, 2 then 2, 4
        opt.apply_gradients([(grad, var)])
        values.append(float(var.numpy()[0]))
    out["accumulated"] = values
    # PartialDistributedOptimizer: gradients from a tape, averaged in apply_gradients
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="shared"),
                              keras.layers.Dense(1, name="local")])  # fmt: skip
    local = model.get_layer("local")
    partial = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    out["has_compute_gradients"] = hasattr(partial, "_compute_gradients")
    x = np.full((4, 3), hvd.rank() + 1.0, "float32")
    with tf.GradientTape() as tape:
        loss = keras.ops.mean(model(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy().copy() for v in model.trainable_variables]
    partial.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    out["steps"] = [(b - v.numpy()).ravel().tolist() for b, v in
                    zip(before, model.trainable_variables, strict=True)]  # fmt: skip
    out["grads"] = [g.numpy().ravel().tolist() for g in grads]
    return out


@pytest.fixture(scope="module")
def keras_ranks() -> list:
    """Both Keras differences from one run of 2 ranks (TensorFlow's start is the cost)."""
    return run_local(_keras_optimizer_differences, num_proc=2, backend="gloo")


def test_keras_backward_passes_per_step_is_refused_naming_gradient_accumulation_steps(keras_ranks):
    # horovod's test_tensorflow2_keras.py test_gradient_aggregation*, test_sparse_as_dense_with_
    # grad_aggregation, test_grad_aggregation_with_inf_grad: horovod accumulated k passes locally.
    zero, one = keras_ranks
    for result in (zero, one):
        assert "backward_passes_per_step=2 is not supported" in result["bpps"]
        assert "gradient_accumulation_steps=2" in result["bpps"]
        # no step after the first pass; the second applies the mean of both passes' averages:
        # ((1 + 2) / 2 + (2 + 4) / 2) / 2 = 2.25
        assert result["accumulated"] == [0.0, -2.25]


def test_keras_partial_distributed_optimizer_averages_in_apply(keras_ranks):
    # horovod's test_partial_distributed_optimizer calls Keras 2's _compute_gradients, which
    # horovod overrode; Keras 3 has no such hook: the gradients are averaged in apply_gradients.
    zero, one = keras_ranks
    for result in (zero, one):
        assert result["has_compute_gradients"] is False
    # the shared layer (kernel, bias): both ranks step by the average of their gradients
    for i in (0, 1):
        mean = [(a + b) / 2 for a, b in zip(zero["grads"][i], one["grads"][i], strict=True)]
        for result in (zero, one):
            assert result["steps"][i] == pytest.approx(mean, rel=1e-5)
    # the local layer: each rank by its own gradient / size (horovod's scale_local_gradients)
    for i in (2, 3):
        for result in (zero, one):
            own = [g / 2 for g in result["grads"][i]]
            assert result["steps"][i] == pytest.approx(own, rel=1e-5)
        assert zero["steps"][i] != pytest.approx(one["steps"][i])
