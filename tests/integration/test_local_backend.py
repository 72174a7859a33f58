"""LocalBackend: an estimator's ranks as local processes, no Spark job (docs/clusters.md).

``fit_on_parquet`` on Parquet written with pyarrow trains through the whole rank path (reader,
collective, checkpoint, hot start, Model) without a SparkSession. The GPU choice of each rank is
checked through the environment (no CUDA needed); ``tests/gpu/estimators_local.py`` runs the
same on a GPU machine and, marked slow here, on the CPU.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spark_estimators import LocalBackend  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import estimators_local  # noqa: E402


def _seen():
    import os

    from spark_estimators.task import get_available_devices, get_device

    return {
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "available": get_available_devices(),
        "device": get_device(),
    }


def test_ranks_spread_over_the_given_gpus():
    out = LocalBackend(3, gpus=["0", "1"], collective_backend="gloo").run(_seen)
    assert [r["local_rank"] for r in out] == [0, 1, 2]
    assert [r["device"] for r in out] == ["cuda:0", "cuda:1", "cuda:0"]
    assert {r["visible"] for r in out} == {"0,1"}
    assert [r["available"] for r in out] == [[], [], []]  # no Spark task, no Spark addresses


def test_use_gpu_false_hides_the_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    backend = LocalBackend(2, use_gpu=False, collective_backend="gloo")
    assert backend.visible_gpus() == []
    assert [r["device"] for r in backend.run(_seen)] == ["cpu", "cpu"]
    assert LocalBackend(1).visible_gpus() == ["0", "1"]  # the variable, when set
    assert LocalBackend(1, gpus=[3]).visible_gpus() == ["3"]


def test_stream_input_is_refused():
    with pytest.raises(ConfigurationError, match="stream"):
        LocalBackend(1).run(_seen, stream_input=object())


def test_fit_on_parquet_without_spark_then_hot_start(tmp_path):
    from pyspark import SparkContext

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    had_spark = SparkContext._active_spark_context is not None
    store = LocalStore(str(tmp_path / "store"))
    x = estimators_local.write_parquet(store, rows=512)

    def estimator(epochs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(estimators_local.N_FEATURES, 1))
        return TorchEstimator(
            store=store,
            backend=LocalBackend(2, collective_backend="gloo"),
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=torch.nn.MSELoss(),
            feature_cols=["features"],
            label_cols=["y"],
            batch_size=32,
            epochs=epochs,
            random_seed=1,
            verbose=0,
            run_id="local",
            scale_lr=False,
        )

    first = estimator(3).fit_on_parquet()
    hist = first.getHistory()
    assert [h["epoch"] for h in hist] == [0, 1, 2]
    assert hist[-1]["loss"] < 0.1 * hist[0]["loss"]
    assert hist[-1]["val_loss"] < 0.1 * hist[0]["val_loss"]
    w = first.getModel()[0].weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, estimators_local.TRUE_W, atol=0.2)
    # Hot start on the same run id: the checkpoint's epochs are kept, one more runs.
    second = estimator(4).fit_on_parquet()
    hist2 = second.getHistory()
    assert [h["epoch"] for h in hist2] == [0, 1, 2, 3] and hist2[:3] == hist
    assert (SparkContext._active_spark_context is not None) == had_spark  # no session started
    with torch.no_grad():
        out = first.getModel()(torch.from_numpy(x[:4])).numpy().ravel()
    np.testing.assert_allclose(out, x[:4] @ estimators_local.TRUE_W + 0.5, atol=0.3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_estimator_check_runs_on_the_cpu(tmp_path):
    """tests/gpu/estimators_local.py with --device cpu: every check but the CUDA dtypes."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/estimators_local.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=850,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["failed"] == []
    assert out["torch_hot_start"]["kept_history"] and out["lightning_bf16"]["kept_history"]
    assert {r["device"] for r in out["torch_gloo_shared"]["ranks"]} == {"cpu"}


@pytest.mark.slow
def test_gpu_bench_runs_tiny_on_the_cpu():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=350,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SKIP (GPU figure)" in proc.stdout
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["device"] == "cpu" and out["ours"][0] > 0 and out["plain"][0] > 0
