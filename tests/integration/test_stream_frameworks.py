"""data="stream" on every estimator (torch, Lightning, Keras), classic and Spark Connect sessions.

The same steps (``scripts/stream_steps.py``: validation by column, no store) run on the classic
``spark`` fixture and from a real Spark Connect client in a child process; each fit must learn
the linear target.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import stream_steps  # noqa: E402


def check(out: dict) -> None:
    losses = out["history"]
    assert len(losses) == 4 and losses[-1] < 0.05 * losses[0]
    assert out["val_loss"] < 0.5
    assert out["n_rows"] == 600 and out["transform_mse"] < 0.5


@pytest.fixture(scope="module")
def stream_df(spark):
    return stream_steps.make_df(spark)


def test_lightning_streams(stream_df):
    pytest.importorskip("pytorch_lightning")
    check(stream_steps.lightning_stream(stream_df))


def test_keras_streams(stream_df):
    pytest.importorskip("keras")
    check(stream_steps.keras_stream(stream_df))


@pytest.mark.parametrize("framework", ["lightning", "keras"])
def test_a_null_label_fails_the_fit_naming_the_column(stream_df, framework):
    pytest.importorskip("pytorch_lightning" if framework == "lightning" else "keras")
    from pyspark.sql import functions as F

    from spark_estimators.errors import TrainingFailedError

    spoiled = F.monotonically_increasing_id() % 97 == 3
    bad = stream_df.withColumn("y", F.when(spoiled, F.lit(None)).otherwise(F.col("y")))
    with pytest.raises(TrainingFailedError) as caught:
        getattr(stream_steps, f"{framework}_stream")(bad)
    # The cause leads the message, not a framework's wrapper or a hang.
    first = str(caught.value).splitlines()[0]
    assert first.startswith("ConfigurationError: column 'y' has null or NaN values"), first


@pytest.mark.slow
def test_every_estimator_streams_from_spark_connect():
    pytest.importorskip("grpc", reason="Spark Connect needs the [connect] extra")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "connect_stream.py")],
        capture_output=True,
        text=True,
        timeout=840,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["session"] == "pyspark.sql.connect.session"
    for framework in ("torch", "lightning", "keras"):
        check(out[framework])
