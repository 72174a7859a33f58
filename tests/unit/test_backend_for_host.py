"""auto/nccl when a host's ranks outnumber its GPUs (found on an H200: NCCL's "invalid usage")."""

from __future__ import annotations

import pytest

from spark_estimators.collective.backends.base import Topology
from spark_estimators.collective.runtime.settings import backend_for_host
from spark_estimators.errors import ConfigurationError


def _topology(size: int, local_size: int) -> Topology:
    return Topology(rank=0, size=size, local_rank=0, local_size=local_size,
                    cross_size=size // local_size, hostname="gpu-host-1")  # fmt: skip


def test_auto_on_one_host_with_fewer_gpus_than_ranks_takes_gloo() -> None:
    assert backend_for_host("nccl", "auto", _topology(2, 2), gpus=1) == "gloo"
    assert backend_for_host("nccl", "auto", _topology(3, 3), gpus=2) == "gloo"


def test_a_gpu_per_rank_keeps_nccl_and_other_backends_pass_through() -> None:
    assert backend_for_host("nccl", "auto", _topology(2, 2), gpus=2) == "nccl"
    assert backend_for_host("nccl", "nccl", _topology(4, 2), gpus=8) == "nccl"
    assert backend_for_host("gloo", "auto", _topology(2, 2), gpus=1) == "gloo"
    # No GPU at all: left to the NCCL backend's own "torch sees none" error.
    assert backend_for_host("nccl", "nccl", _topology(2, 2), gpus=0) == "nccl"


@pytest.mark.parametrize(("requested", "size"), [("nccl", 2), ("auto", 4)])
def test_nccl_or_several_hosts_sharing_a_gpu_is_refused(requested: str, size: int) -> None:
    with pytest.raises(ConfigurationError) as err:
        backend_for_host("nccl", requested, _topology(size, 2), gpus=1)
    text = str(err.value)
    assert "2 ranks on host gpu-host-1 share 1 GPU(s)" in text
    assert "spark.task.resource.gpu.amount=1" in text and "'gloo'" in text
