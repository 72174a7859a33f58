"""The seed docs' Horovod-on-Spark examples run with only their imports changed (issue 21).

Each example is a file in ``examples/`` whose header names its seed section and lists the lines
that differ. The other ported examples are tested next to their estimators:
``test_keras_examples.py`` (the KerasEstimator example and a horovod.tensorflow.keras script),
``test_torch_estimator.py::test_ported_horovod_mnist_example_runs`` and
``test_lightning_example.py`` (horovod's Lightning MNIST example the seed links to).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import spark_estimators
from spark_estimators.errors import ConfigurationError

EXAMPLES = Path(__file__).parent / "examples"
ROOT = EXAMPLES.parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env


def _results(stdout: str) -> list:
    """The JSON of every ``RESULT ...`` line (launcher lines carry a ``[rank]`` prefix)."""
    return [
        json.loads(line.partition("RESULT ")[2])
        for line in stdout.splitlines()
        if "RESULT " in line
    ]


def _run(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, *args]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_env()
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_seed_run_hello_world_prints_every_rank_and_returns_ranks(tmp_path):
    # The script makes its own local[2] session, as the pyspark shell would: num_proc defaults
    # to spark.default.parallelism (2).
    proc = _run([str(EXAMPLES / "seed_run_hello.py")], tmp_path, 280)
    (ranks,) = _results(proc.stdout)
    assert ranks == [0, 1]
    hello = sorted(line for line in proc.stdout.splitlines() if "Hello, rank" in line)
    assert hello == [
        f"[{r}]Hello, rank = {r}, local_rank = {r}, size = 2, local_size = 2, magic_number = 42"
        for r in (0, 1)
    ], proc.stdout


def _check_torch_script_results(results: list[dict]) -> None:
    results = sorted(results, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    # DistributedSampler gave each rank half of the 512 rows.
    assert [r["shard"] for r in results] == [256, 256]
    # Different initial weights (seeded by rank), yet one model after the broadcast + allreduce.
    assert results[0]["weights"] == results[1]["weights"]
    for r in results:
        assert r["losses"][-1] < 0.5 * r["losses"][0], r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_seed_torch_script_under_the_launcher(tmp_path):
    # horovodrun -np 2 python train.py  ->  python -m spark_estimators.launch -np 2 train.py
    script = EXAMPLES / "seed_torch_script.py"
    proc = _run(["-m", "spark_estimators.launch", "-np", "2", str(script)], tmp_path, 280)
    _check_torch_script_results(_results(proc.stdout))
    epochs = [line for line in proc.stdout.splitlines() if "Train Epoch: 2 [0/256]" in line]
    assert sorted(line[:3] for line in epochs) == ["[0]", "[1]"], proc.stdout


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_seed_torch_script_inside_spark_run(spark):
    # "Horovod Spark Run": the same training code, as a function, in Spark tasks.
    module = _load("seed_torch_script")
    _check_torch_script_results(spark_estimators.run(module.main, num_proc=2))


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_seed_fit_on_parquet_and_prepare_data_examples(tmp_path):
    # num_proc=4 as in the seed, on the example's own local[4] session: minutes on 2 cores.
    proc = _run([str(EXAMPLES / "seed_keras_parquet.py")], tmp_path, 1150)
    (result,) = _results(proc.stdout)
    # fit_on_parquet() on Parquet written by Spark at the store's train_path/val_path.
    assert result["parquet_epochs"] == 10
    assert result["parquet_last_loss"] < 0.5 * result["parquet_first_loss"], result
    assert result["parquet_val_loss"] is not None  # the val_path data was used
    assert result["pred_shape"] == [1, 1]
    assert result["pred_ones"] > 0.5  # features (1, 1): x0 + 2 x1 > 0, class 1
    # The store without prefix_path keeps runs/ next to the data.
    assert len(result["runs_dir"]) == 2, result
    # util.prepare_data wrote one dataset; fit_on_parquet() trained on it.
    assert len(result["datasets"]) == 1, result
    assert result["prepared_epochs"] == 10
    assert result["prepared_val_loss"] is not None
    assert result["test_accuracy"] > 0.9, result


def test_store_without_prefix_keeps_runs_next_to_the_data(tmp_path):
    # The seed's HDFSStore(train_path=..., val_path=...) has no prefix_path.
    from spark_estimators.store import HDFSStore, LocalStore

    local = LocalStore(train_path=f"{tmp_path}/u/training_dataset", val_path=f"{tmp_path}/u/val")
    assert local.get_train_data_path() == f"{tmp_path}/u/training_dataset"
    assert local.get_val_data_path() == f"{tmp_path}/u/val"
    assert local.get_runs_path() == f"{tmp_path}/u/runs"
    hdfs = HDFSStore(train_path="/user/me/training_dataset", val_path="/user/me/val_dataset")
    assert hdfs.get_runs_path() == "hdfs:///user/me/runs"
    with pytest.raises(ConfigurationError, match="needs a prefix_path"):
        LocalStore()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_horovod_util_prepare_data_yields_the_index_fit_on_parquet_uses(spark, tmp_path):
    from spark_estimators.data import DatasetMetadata
    from spark_estimators.data import horovod_util as util
    from spark_estimators.store import Store

    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(
        [(float(i), float(i % 2), 2.0 * i) for i in range(40)], ["a", "b", "y"]
    )
    # horovod's positional order: label_columns before feature_columns; no feature_columns
    # means every column that is not a label.
    with util.prepare_data(2, store, df, ["y"], validation=0.25) as idx:
        meta = DatasetMetadata.load(store, idx)
    assert store.list_datasets() == [idx]
    assert sorted(meta.columns) == ["a", "b", "y"]
    assert meta.train_rows + meta.val_rows == 40
    assert meta.val_rows > 0
    with (
        pytest.raises(ConfigurationError, match="label_columns"),
        util.prepare_data(2, store, df, []),
    ):
        pass
