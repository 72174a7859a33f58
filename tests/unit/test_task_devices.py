"""Device helpers of a rank: Spark's GPU addresses (Horovod's meaning) and the torch device."""

from __future__ import annotations

import pytest

from spark_estimators.task import get_available_devices, get_device, get_devices
from spark_estimators.task.spark_task import rank_environment


class _Settings:
    master_addr, master_port, rank, size = "127.0.0.1", 1234, 1, 2
    local_rank, local_size, cross_rank, cross_size, host_hash = 1, 2, 0, 1, "h"


def test_rank_environment_masks_cuda_and_keeps_spark_addresses(monkeypatch):
    env = rank_environment(_Settings(), ("3",), "gloo")
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    monkeypatch.setenv("SPARK_ESTIMATORS_GPU_ADDRESSES", env["SPARK_ESTIMATORS_GPU_ADDRESSES"])
    assert get_available_devices() == ["3"]
    assert get_devices() == ["cuda:0"] and get_device() == "cuda:0"


def test_no_gpus(monkeypatch):
    env = rank_environment(_Settings(), (), "gloo")
    assert "CUDA_VISIBLE_DEVICES" not in env and "SPARK_ESTIMATORS_GPU_ADDRESSES" not in env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SPARK_ESTIMATORS_GPU_ADDRESSES", raising=False)
    assert get_available_devices() == []
    assert get_device() == "cpu"


@pytest.mark.parametrize(("visible", "want"), [("2,5", ["cuda:0", "cuda:1"]), ("", ["cpu"])])
def test_devices_follow_cuda_visible_devices(monkeypatch, visible, want):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert get_devices() == want
