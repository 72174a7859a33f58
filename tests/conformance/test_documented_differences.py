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
