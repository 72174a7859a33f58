"""Our documented behaviour where a ported horovod TensorFlow test expects horovod's.

The horovod tests of ``parallel/test_tensorflow.py`` that differ deliberately (listed in
docs/conformance.md) carry an ``xfail`` naming this file; these tests check what we do instead,
as docs/tensorflow.md describes it. They run 2 real ranks with the local launcher.
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
