"""Device helpers of a rank: Spark's GPU addresses (Horovod's meaning) and the torch device.

The GPU layouts (docs/clusters.md, "GPUs") are checked through the real rank assignment and rank
environment: each rank's ``CUDA_VISIBLE_DEVICES`` says which physical GPU each CUDA index is, so
the tests can tell where horovod's two idioms and ``get_device()`` land without a GPU.
"""

from __future__ import annotations

import pytest

from spark_estimators import envvars as ev
from spark_estimators._base.gpus import own_cuda_indices
from spark_estimators.driver.service import Registration, assign_ranks
from spark_estimators.task import get_available_devices, get_device, get_devices
from spark_estimators.task.spark_task import rank_environment


class _Settings:
    master_addr, master_port, rank, size = "127.0.0.1", 1234, 1, 2
    local_rank, local_size, cross_rank, cross_size, host_hash = 1, 2, 0, 1, "h"


def _reg(index: int, host: str, gpus: tuple[str, ...]) -> Registration:
    return Registration(index, host, host, 100 + index, "127.0.0.1", 5000 + index, gpus)


def _ranks(regs: list[Registration]) -> list[dict]:
    """What each rank (by rank) sees: its env, and the physical GPU each idiom picks."""
    settings = assign_ranks(regs)
    out = []
    for reg in regs:
        s = settings[reg.index]
        env = rank_environment(s, reg.gpus, "gloo")
        visible = env[ev.CUDA_VISIBLE_DEVICES].split(",")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ev.CUDA_VISIBLE_DEVICES, env[ev.CUDA_VISIBLE_DEVICES])
            mp.setenv(ev.SE_GPU_ADDRESSES, env[ev.SE_GPU_ADDRESSES])
            mp.setenv(ev.SE_LOCAL_RANK, env[ev.SE_LOCAL_RANK])
            available, device = get_available_devices(), get_device()
        own_index = int(device.split(":")[1])
        first = int(available[0])
        out.append(
            {
                "rank": s.rank,
                "host": reg.host,
                "task_gpus": list(reg.gpus),
                "available": available,
                "local_rank": s.local_rank,
                "visible": visible,
                # torch.cuda.set_device(hvd.local_rank())
                "set_device_local_rank": visible[s.local_rank],
                # tf...set_visible_devices(gpus[int(get_available_devices()[0])], 'GPU')
                "tf_idiom": visible[first] if first < len(visible) else None,
                "get_device": visible[own_index],
            }
        )
    return sorted(out, key=lambda r: r["rank"])


def test_several_executors_two_gpus_each_both_idioms_land_on_the_own_gpu():
    # Two hosts (executors) x 2 GPUs; tasks interleave and Spark handed the addresses out in
    # an order that is not the task order.
    regs = [
        _reg(0, "a", ("1",)),
        _reg(1, "b", ("0",)),
        _reg(2, "a", ("0",)),
        _reg(3, "b", ("1",)),
    ]
    ranks = _ranks(regs)
    for r in ranks:
        own = r["task_gpus"][0]
        assert r["visible"] == ["0", "1"]
        assert r["local_rank"] == int(own)  # local ranks follow the GPU addresses
        assert r["set_device_local_rank"] == own
        assert r["tf_idiom"] == own
        assert r["get_device"] == own
    for host in "ab":
        assert sorted(r["get_device"] for r in ranks if r["host"] == host) == ["0", "1"]
    assert [r["host"] for r in ranks] == ["a", "a", "b", "b"]


def test_executor_with_gpus_2_and_3():
    # The executor got GPUs "2","3" (another executor on the node holds 0 and 1).
    ranks = _ranks([_reg(0, "h", ("3",)), _reg(1, "h", ("2",))])
    assert [r["available"] for r in ranks] == [["2"], ["3"]]
    for r in ranks:
        assert r["visible"] == ["2", "3"]
        assert r["get_device"] == r["task_gpus"][0]
        assert r["set_device_local_rank"] == r["task_gpus"][0]
        # The addresses are not indices of the rank's list here: horovod's TF idiom indexes
        # past it (docs/clusters.md says so); get_device() is the portable way.
        assert r["tf_idiom"] is None
    assert {r["get_device"] for r in ranks} == {"2", "3"}


def test_two_gpus_per_task():
    regs = [_reg(0, "h", ("2", "3")), _reg(1, "h", ("0", "1"))]
    settings = assign_ranks(regs)
    assert settings[1].local_rank == 0 and settings[0].local_rank == 1
    env = rank_environment(settings[0], regs[0].gpus, "gloo")
    assert env[ev.CUDA_VISIBLE_DEVICES] == "0,1,2,3"
    assert env[ev.SE_GPU_ADDRESSES] == "2,3"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ev.CUDA_VISIBLE_DEVICES, env[ev.CUDA_VISIBLE_DEVICES])
        mp.setenv(ev.SE_GPU_ADDRESSES, env[ev.SE_GPU_ADDRESSES])
        assert get_devices() == ["cuda:2", "cuda:3"]
        assert get_device() == "cuda:2"
    ranks = _ranks(regs)
    assert [r["get_device"] for r in ranks] == ["0", "2"]
    assert [r["tf_idiom"] for r in ranks] == ["0", "2"]
    # horovod's set_device(local_rank) assumes one GPU per process: local rank 1 gets GPU 1.
    assert [r["set_device_local_rank"] for r in ranks] == ["0", "1"]


def test_numeric_order_of_addresses():
    regs = [_reg(i, "h", (a,)) for i, a in enumerate(["10", "2", "1", "0"])]
    settings = assign_ranks(regs)
    assert settings[0].host_gpus == ("0", "1", "2", "10")
    assert [settings[i].local_rank for i in range(4)] == [3, 2, 1, 0]
    assert [settings[i].rank for i in range(4)] == [3, 2, 1, 0]


def test_without_gpus_ranks_keep_task_order():
    settings = assign_ranks([_reg(1, "h", ()), _reg(0, "h", ())])
    assert settings[0].rank == 0 and settings[1].rank == 1
    assert settings[0].host_gpus == ()


def test_rank_environment_without_host_gpus_shows_the_task_gpus(monkeypatch):
    env = rank_environment(_Settings(), ("3",), "gloo")
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    monkeypatch.setenv("SPARK_ESTIMATORS_GPU_ADDRESSES", env["SPARK_ESTIMATORS_GPU_ADDRESSES"])
    assert get_available_devices() == ["3"]
    assert get_devices() == ["cuda:0"] and get_device() == "cuda:0"


@pytest.mark.parametrize(
    ("visible", "addresses", "want"),
    [
        (None, "3", [3]),  # an elastic worker keeps the executor's (unmasked) view
        ("4,5", "1", [1]),  # a discovery script that numbers the executor's visible GPUs
        ("4,5", "5", [1]),
        ("0,1", "7", []),  # not a GPU of this process
    ],
)
def test_own_cuda_indices_on_other_views(visible, addresses, want):
    env = {ev.SE_GPU_ADDRESSES: addresses}
    if visible is not None:
        env[ev.CUDA_VISIBLE_DEVICES] = visible
    assert own_cuda_indices(env) == want


def test_no_gpus(monkeypatch):
    env = rank_environment(_Settings(), (), "gloo")
    assert "CUDA_VISIBLE_DEVICES" not in env and "SPARK_ESTIMATORS_GPU_ADDRESSES" not in env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SPARK_ESTIMATORS_GPU_ADDRESSES", raising=False)
    assert get_available_devices() == []
    assert get_device() == "cpu"


@pytest.mark.parametrize(
    ("visible", "local_rank", "want"),
    [("2,5", "0", ["cuda:0", "cuda:1"]), ("2,5", "1", ["cuda:1", "cuda:0"]), ("", "0", ["cpu"])],
)
def test_local_launcher_spreads_ranks_over_visible_gpus(monkeypatch, visible, local_rank, want):
    monkeypatch.delenv("SPARK_ESTIMATORS_GPU_ADDRESSES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("SPARK_ESTIMATORS_LOCAL_RANK", local_rank)
    assert get_devices() == want
