"""Real cluster modes: a Spark standalone cluster, and GPU scheduling with fake GPUs on CPU.

Each runs in its own process with its own SparkSession (a classic local[2] session already lives in
this one).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(400)]

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _result(script: str, timeout: int) -> dict | list:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script)], capture_output=True, text=True, timeout=timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT ") :])


def test_standalone_cluster_master_and_two_workers():
    pytest.importorskip("torch")
    out = _result("standalone_fit.py", 380)
    # One rank per Worker: the executors' salted host names differ.
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    assert out["ranks"][0]["host"] != out["ranks"][1]["host"]
    losses = out["fit"]["history"]
    assert len(losses) == 4 and losses[-1] < 0.01 < losses[0]
    assert out["fit"]["transform_mse"] < 0.01
    # data="stream" (issue 29): each executor's task spills its partition for its rank.
    streamed = out["stream_fit"]["history"]
    assert len(streamed) == 4 and streamed[-1] < 0.01 < streamed[0]
    assert out["stream_fit"]["transform_mse"] < 0.01
    assert out["server_pids_alive"] == []


def test_fake_gpus_each_rank_gets_its_spark_address():
    out = _result("fake_gpu_ranks.py", 300)
    assert [r["rank"] for r in out] == [0, 1]
    # Spark gave each task one of the executor's two GPUs: masked, Horovod-style addresses.
    addresses = sorted(r["available"][0] for r in out)
    assert addresses == ["0", "1"]
    for r in out:
        assert len(r["available"]) == 1
        assert r["cuda_visible_devices"] == r["available"][0]
        assert r["device"] == "cuda:0"
    # LOCAL_RANK keeps torchrun's meaning (rank on this host), which is not the GPU index here.
    assert sorted(r["local_rank"] for r in out) == [0, 1]
