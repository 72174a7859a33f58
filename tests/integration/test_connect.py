"""The public API from a Spark Connect client, step for step against a classic session.

A real local Spark Connect server (``SparkSession.builder.remote("local[2]")``) runs in a child
process (a classic session already lives in this one) and drives ``scripts/connect_steps.py``:
run, run_elastic, the README quickstart (TorchEstimator fit + transform), fit_on_parquet,
Pipeline save/load, bad input, and a LightningEstimator and a KerasEstimator fit + transform.
The same steps then run here on the classic ``spark`` fixture, and both must give the same
answers.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("grpc", reason="Spark Connect needs the [connect] extra")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import connect_steps  # noqa: E402


@pytest.fixture(scope="module")
def connect_result() -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "connect_client.py")],
        capture_output=True,
        text=True,
        timeout=840,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def classic_result(spark, tmp_path_factory) -> dict:
    out = connect_steps.all_steps(spark, str(tmp_path_factory.mktemp("classic")))
    return json.loads(json.dumps(out, default=lambda o: np.asarray(o).tolist()))


def test_the_client_really_is_spark_connect(connect_result):
    assert connect_result["session"] == "pyspark.sql.connect.session"


@pytest.mark.parametrize("kind", ["connect", "classic"])
def test_run_and_run_elastic(kind, connect_result, classic_result):
    out = connect_result if kind == "connect" else classic_result
    assert out["run"] == [[0, 42, 3.0], [1, 42, 3.0]]
    assert out["run_elastic"] == [[0, 3.0], [1, 3.0]]


@pytest.mark.parametrize("kind", ["connect", "classic"])
def test_quickstart_fit_transform_pipeline(kind, connect_result, classic_result):
    out = connect_result if kind == "connect" else classic_result
    losses = out["history"]
    assert len(losses) == 5 and losses[-1] < 1e-3 < 1.0 < losses[0]
    assert out["val_history"][-1] < 1e-3
    np.testing.assert_allclose(out["weights"], connect_steps.TRUE_W, atol=0.02)
    assert out["n_rows"] == 600 and out["transform_mse"] < 1e-3
    assert out["fit_on_parquet_loss"] > 0
    assert out["pipeline_max_diff"] < 1e-6


@pytest.mark.parametrize("framework", ["lightning", "keras"])
@pytest.mark.parametrize("kind", ["connect", "classic"])
def test_lightning_and_keras_estimators(kind, framework, connect_result, classic_result):
    out = (connect_result if kind == "connect" else classic_result)[framework]
    losses = out["history"]
    assert len(losses) == 4 and losses[-1] < 0.05 * losses[0]
    assert out["n_rows"] == 600 and out["transform_mse"] < 0.5


def test_connect_and_classic_give_the_same_model(connect_result, classic_result):
    np.testing.assert_allclose(connect_result["weights"], classic_result["weights"], atol=1e-3)
    np.testing.assert_allclose(
        connect_result["history"][-1], classic_result["history"][-1], atol=1e-3
    )


def test_bad_input_gives_the_same_error_before_any_job(connect_result, classic_result):
    bad = connect_result["bad_input"]
    assert bad == classic_result["bad_input"]
    assert bad["missing_column"].startswith("ConfigurationError: column(s) ['nope'] not found")
    assert bad["too_many_ranks"].startswith("ConfigurationError: num_proc=3 needs 3")
