"""Our documented behaviour where a ported horovod test expects horovod's (docs/conformance.md).

Each horovod test that fails here because of a deliberate difference carries an
``xfail(strict=True, reason="documented difference: ...")`` mark; this file tests what we do
instead, as docs/migration.md describes it.
"""

from __future__ import annotations

import io
import os
import re
import sys
import time

import pytest

sys.path.append(os.path.join(os.path.dirname(__file__), "utils"))

from spark_common import create_xor_data, local_store, spark_session  # noqa: E402

import spark_estimators  # noqa: E402
from spark_estimators.errors import ConfigurationError, SparkEstimatorsError  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess]


def _say_hello():
    import spark_estimators.collective.torch as hvd

    hvd.init()
    print(f"running fn {hvd.size()}")
    print("error line", file=sys.stderr)
    return hvd.rank()


def test_run_output_lines_are_prefixed_with_the_rank():
    # horovod's test_happy_run_with_gloo expects "[0]<stdout>:running fn 2".
    stdout, stderr = io.StringIO(), io.StringIO()
    with spark_session("documented"):
        res = spark_estimators.run(
            _say_hello, num_proc=2, start_timeout=60, stdout=stdout, stderr=stderr, verbose=0
        )
    assert res == [0, 1]
    assert sorted(re.findall(r"^\[([01])\]running fn 2$", stdout.getvalue(), re.M)) == ["0", "1"]
    assert sorted(re.findall(r"^\[([01])\]error line$", stderr.getvalue(), re.M)) == ["0", "1"]


def test_run_with_more_ranks_than_task_slots_fails_at_once():
    # horovod's test_timeout_with_gloo waits start_timeout for tasks that cannot all start.
    with spark_session("documented") as spark:
        slots = spark.sparkContext.defaultParallelism
        start = time.monotonic()
        with pytest.raises(SparkEstimatorsError, match=rf"\b{slots}\b.*slot|slot.*\b{slots}\b"):
            spark_estimators.run(_say_hello, num_proc=slots + 2, start_timeout=30, verbose=0)
        assert time.monotonic() - start < 15
        with pytest.raises(ConfigurationError, match="fn must be callable"):
            spark_estimators.run(None, num_proc=2, verbose=0)


def _torch_xor_estimator(store, **kwargs):
    import torch

    import spark_estimators.torch as hvd_spark

    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Sigmoid())
    return hvd_spark.TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.functional.binary_cross_entropy,
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=1,
        epochs=1,
        **kwargs,
    )


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_mp_start_method_is_refused_in_the_driver(method):
    # horovod's Keras and Lightning test_fit_model set mp_start_method (its petastorm pool's).
    with spark_session("documented") as spark, local_store() as store:
        df = create_xor_data(spark)
        est = _torch_xor_estimator(store, mp_start_method=method)
        start = time.monotonic()
        with pytest.raises(ConfigurationError, match="mp_start_method.*remove mp_start_method"):
            est.fit(df)
        assert time.monotonic() - start < 10


def test_tensorflow_dataset_prefetch_buffer_size_is_refused_in_the_driver():
    keras = pytest.importorskip("keras")
    import spark_estimators.keras as hvd

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid")])
    with pytest.raises(ConfigurationError, match="tensorflow_dataset_prefetch_buffer_size"):
        hvd.KerasEstimator(
            num_proc=2,
            model=model,
            optimizer=keras.optimizers.SGD(learning_rate=0.1),
            loss="binary_crossentropy",
            feature_cols=["features"],
            label_cols=["y"],
            tensorflow_dataset_prefetch_buffer_size=1,
        )


def test_lightning_estimator_refuses_a_plain_module_with_optimizer_and_loss():
    # horovod's test_legacy_fit_model wrapped a torch.nn.Module, optimizer and loss into a
    # LightningModule; here the Lightning estimator takes LightningModules and TorchEstimator
    # takes the plain module.
    torch = pytest.importorskip("torch")
    pytest.importorskip("pytorch_lightning")
    import spark_estimators.lightning as hvd_spark

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigurationError, match="configure_optimizers"):
        hvd_spark.TorchEstimator(
            num_proc=2,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=torch.nn.functional.binary_cross_entropy,
            feature_cols=["features"],
            label_cols=["y"],
        )


def _ops_out_of_submission_order():
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    rank = hvd.rank()
    # horovod matched queued ops by name, in any order; here every rank negotiates its ops in
    # submission order, and a different order fails on every rank instead of waiting.
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    handles = [hvd.allreduce_async(torch.ones(3), name=n) for n in names]
    errors = []
    for h in handles:
        try:
            hvd.synchronize(h)
        except CollectiveError as exc:
            errors.append(str(exc).splitlines()[0])
    # Nothing was exchanged by the mismatched ops: the group is still usable.
    total = float(hvd.allreduce(torch.ones(1) * (rank + 1), op=hvd.Sum, name="after")[0])
    hvd.shutdown()
    return errors, total


@pytest.mark.timeout(180)
def test_ops_are_negotiated_in_submission_order():
    # horovod's *_duplicate_name_error tests queue an async op on rank 0 only and meet rank 1 at
    # a barrier first: that needs matching by name. Here: the same order on every rank.
    from spark_estimators.launch import run_local

    results = run_local(_ops_out_of_submission_order, num_proc=2, backend="gloo")
    for errors, total in results:
        assert errors and all("mismatched collective op" in e for e in errors)
        assert total == 3.0


def _fresh_optimizer_state_broadcast():
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out = {
        "grads": [p.grad is None for p in model.parameters()],
        "unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
        "weights": [p.detach().tolist() for p in model.parameters()],
    }
    hvd.shutdown()
    return out


@pytest.mark.timeout(180)
def test_broadcast_optimizer_state_takes_no_initialising_step():
    # horovod's test_broadcast_state_no_grad expects the zero gradients of horovod's
    # state-initialising optimizer.step(); we take no step: weights are not moved (weight decay
    # would move them) and gradients stay None until the first backward.
    from spark_estimators.launch import run_local

    results = run_local(_fresh_optimizer_state_broadcast, num_proc=2, backend="gloo")
    for res in results:
        assert res["grads"] == [True, True] and res["unchanged"]
    assert results[0]["weights"] == results[1]["weights"]
