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
    name, *args = script.split()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
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


def _idioms(r: dict) -> dict:
    """The physical GPU that each way of pinning picks in rank ``r`` (None: an invalid index)."""
    visible = r["cuda_visible_devices"].split(",")
    first = int(r["available"][0])
    return {
        # torch.cuda.set_device(hvd.local_rank())
        "set_device": visible[r["local_rank"]] if r["local_rank"] < len(visible) else None,
        # tf.config.experimental.set_visible_devices(gpus[int(get_available_devices()[0])])
        "tf": visible[first] if first < len(visible) else None,
        "get_device": visible[int(r["device"].split(":")[1])],
    }


def test_fake_gpus_two_executors_both_idioms_land_on_the_own_gpu():
    out = _result("fake_gpu_ranks.py 2", 300)
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    hosts = sorted({r["host"] for r in out})
    assert len(hosts) == 2
    for host in hosts:
        on_host = [r for r in out if r["host"] == host]
        # Spark gave each task one of its executor's two GPUs; the rank sees both, in order.
        assert sorted(r["available"][0] for r in on_host) == ["0", "1"]
        assert sorted(r["local_rank"] for r in on_host) == [0, 1]
        for r in on_host:
            own = r["available"][0]
            assert r["cuda_visible_devices"] == "0,1"
            assert _idioms(r) == {"set_device": own, "tf": own, "get_device": own}


@pytest.mark.slow
def test_fake_gpus_addresses_2_3_and_two_per_task():
    out = _result("fake_gpu_ranks.py 1 2,3", 300)
    assert sorted(r["available"][0] for r in out) == ["2", "3"]
    for r in out:
        own = r["available"][0]
        assert r["cuda_visible_devices"] == "2,3"
        assert _idioms(r) == {"set_device": own, "tf": None, "get_device": own}
    out = _result("fake_gpu_ranks.py 1 0,1,2,3 2", 300)
    assert sorted(tuple(r["available"]) for r in out) == [("0", "1"), ("2", "3")]
    for r in out:
        assert r["cuda_visible_devices"] == "0,1,2,3"
        assert _idioms(r)["get_device"] == r["available"][0]
