"""The collective core in one process: settings, registry, errors before init, bucket planning,
and a job of one over gloo and over a numpy-only backend (the shape the MPI backend will have).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import spark_estimators.collective as hvd
from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import (
    Backend,
    ReduceOp,
    Topology,
    backend_class,
    register_backend,
    resolve_op,
)
from spark_estimators.collective.runtime import settings
from spark_estimators.collective.runtime.requests import signature_hash
from spark_estimators.errors import CollectiveError, ConfigurationError

ALL_RANK_VARS = [
    ev.SE_RANK, ev.SE_SIZE, ev.SE_LOCAL_RANK, ev.SE_LOCAL_SIZE, ev.SE_CROSS_RANK,
    ev.SE_CROSS_SIZE, ev.SE_MASTER_ADDR, ev.SE_MASTER_PORT, ev.SE_BACKEND, ev.SE_HOSTNAME,
    ev.RANK, ev.WORLD_SIZE, ev.LOCAL_RANK, ev.LOCAL_WORLD_SIZE, ev.GROUP_RANK,
    settings.GROUP_WORLD_SIZE, ev.MASTER_ADDR, ev.MASTER_PORT, ev.FUSION_THRESHOLD,
    ev.COLLECTIVE_TIMEOUT, ev.START_TIMEOUT,
]  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for name in ALL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def single_process(clean_env):
    """A job of one over gloo in this process, shut down afterwards."""
    hvd.init(backend="gloo")
    try:
        yield
    finally:
        hvd.shutdown()


# -- before init -----------------------------------------------------------------------------
def test_ops_before_init_say_so():
    import torch

    import spark_estimators.collective.torch as thvd

    assert not hvd.is_initialized()
    for call in (
        hvd.rank,
        lambda: hvd.allreduce(np.ones(2)),
        lambda: thvd.allreduce(torch.ones(2)),
        lambda: thvd.allgather(torch.ones(2)),
        thvd.barrier,
    ):
        with pytest.raises(CollectiveError, match=r"before init\(\).*init\(\)"):
            call()


# -- settings --------------------------------------------------------------------------------
def test_topology_prefers_our_variables(clean_env):
    clean_env.setenv(ev.SE_RANK, "3")
    clean_env.setenv(ev.SE_SIZE, "4")
    clean_env.setenv(ev.SE_LOCAL_RANK, "1")
    clean_env.setenv(ev.SE_LOCAL_SIZE, "2")
    clean_env.setenv(ev.SE_CROSS_RANK, "1")
    clean_env.setenv(ev.SE_CROSS_SIZE, "2")
    clean_env.setenv(ev.SE_MASTER_ADDR, "10.0.0.1")
    clean_env.setenv(ev.SE_MASTER_PORT, "2222")
    clean_env.setenv(ev.RANK, "0")  # torchrun's value loses
    clean_env.setenv(ev.MASTER_PORT, "1")
    topo = settings.topology_from_env()
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (3, 4, 1, 2)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)
    assert (topo.master_addr, topo.master_port) == ("10.0.0.1", 2222)


def test_topology_falls_back_to_torchrun(clean_env):
    for name, value in {
        ev.RANK: "5", ev.WORLD_SIZE: "8", ev.LOCAL_RANK: "1", ev.LOCAL_WORLD_SIZE: "4",
        ev.GROUP_RANK: "1", settings.GROUP_WORLD_SIZE: "2", ev.MASTER_ADDR: "h",
        ev.MASTER_PORT: "29500",
    }.items():  # fmt: skip
        clean_env.setenv(name, value)
    topo = settings.topology_from_env()
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (5, 8, 1, 4)
    assert (topo.cross_rank, topo.cross_size, topo.master_port) == (1, 2, 29500)


def test_topology_defaults_to_a_job_of_one(clean_env):
    topo = settings.topology_from_env()
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (0, 1, 0, 1)
    assert (topo.cross_rank, topo.cross_size) == (0, 1)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({ev.SE_RANK: "x", ev.SE_SIZE: "2"}, "SPARK_ESTIMATORS_RANK='x' is not an integer"),
        ({ev.SE_RANK: "2", ev.SE_SIZE: "2", ev.SE_MASTER_ADDR: "h", ev.SE_MASTER_PORT: "1"},
         r"rank=2 must be in \[0, size=2\)"),
        ({ev.SE_RANK: "1", ev.SE_SIZE: "2"}, "need a rendezvous point"),
    ],
)  # fmt: skip
def test_topology_errors_name_the_variable(clean_env, env, match):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigurationError, match=match):
        settings.topology_from_env()


def test_backend_choice(clean_env):
    assert settings.requested_backend() == "auto"
    clean_env.setenv(ev.SE_BACKEND, "gloo")
    assert settings.requested_backend() == "gloo"
    assert settings.requested_backend("nccl") == "nccl"
    with pytest.raises(ConfigurationError, match="'tcp' is not one of auto, gloo, nccl, mpi"):
        settings.requested_backend("tcp")
    import torch

    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert settings.resolve_backend("auto") == expected
    with pytest.raises(ConfigurationError, match="unknown"):
        backend_class("tcp")


def test_timeouts_and_fusion_threshold(clean_env):
    assert settings.collective_timeout() == ev.DEFAULT_COLLECTIVE_TIMEOUT
    clean_env.setenv(ev.COLLECTIVE_TIMEOUT, "7.5")
    assert settings.collective_timeout() == 7.5
    assert settings.collective_timeout(3) == 3.0
    with pytest.raises(ConfigurationError, match="must be > 0"):
        settings.collective_timeout(0)
    assert settings.fusion_threshold() == 128 * 1024 * 1024
    clean_env.setenv(ev.FUSION_THRESHOLD, "0")
    assert settings.fusion_threshold() == 0
    assert settings.fusion_threshold(1024) == 1024
    with pytest.raises(
        ConfigurationError,
        match=r"fusion threshold must be >= 0 bytes \(0 disables fusion\), got -1 "
        r"\(SPARK_ESTIMATORS_FUSION_THRESHOLD\)",
    ):
        settings.fusion_threshold(-1)


def test_reduce_ops_keep_horovods_names():
    assert resolve_op(None) is ReduceOp.AVERAGE
    assert resolve_op(None, average=False) is ReduceOp.SUM
    assert resolve_op(hvd.Max) is ReduceOp.MAX
    assert (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 3, 4, 5)
    with pytest.raises(ConfigurationError, match="Adasum is not supported"):
        resolve_op(hvd.Adasum)
    with pytest.raises(ConfigurationError, match="not both"):
        resolve_op(hvd.Sum, average=True)


def test_signature_hash_is_stable_and_discriminating():
    a = ("ALLREDUCE", "w", "float32", "cpu", ((2, 3),), "AVERAGE", 1.0, 1.0)
    assert signature_hash(a) == signature_hash(tuple(a))
    assert signature_hash(a) != signature_hash(a[:4] + (((3, 2),),) + a[5:])
    # the same on every run, independent of PYTHONHASHSEED
    code = (
        "from spark_estimators.collective.runtime.requests import signature_hash\n"
        "print(signature_hash(('x', 1)))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout  # fmt: skip
        for seed in ("1", "2")
    }
    assert runs == {f"{signature_hash(('x', 1))}\n"}


def test_core_modules_import_no_framework():
    modules = [
        "spark_estimators.collective",
        "spark_estimators.collective.backends.base",
        "spark_estimators.collective.runtime.engine",
        "spark_estimators.collective.runtime.allreduce",
        "spark_estimators.collective.runtime.ops",
        "spark_estimators.collective.runtime.settings",
        "spark_estimators.collective.backends.torch_distributed",
        "spark_estimators.launch",
    ]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps([m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


# -- bucket planning -------------------------------------------------------------------------
def test_plan_buckets():
    import torch

    from spark_estimators.collective.torch.optimizer import plan_buckets

    f = [torch.zeros(100) for _ in range(4)]  # 400 bytes each
    h = torch.zeros(10, dtype=torch.float16)
    assert [len(b) for b in plan_buckets(f, threshold=1000)] == [2, 2]
    assert [len(b) for b in plan_buckets(f, threshold=0)] == [1, 1, 1, 1]
    assert [len(b) for b in plan_buckets(f, threshold=10)] == [1, 1, 1, 1]  # too big: alone
    assert [len(b) for b in plan_buckets([*f[:2], h, f[2]], threshold=10**6)] == [2, 1, 1]
    assert [len(b) for b in plan_buckets(f, 1000, bytes_per_element={torch.float32: 2})] == [4]
    groups = plan_buckets(f, threshold=10**6, groups=[[f[3], f[0]]])
    assert [[id(p) for p in b] for b in groups] == [[id(f[3]), id(f[0])], [id(f[1])], [id(f[2])]]


# -- a job of one ----------------------------------------------------------------------------
def test_job_of_one_over_gloo(single_process):
    import torch

    import spark_estimators.collective.torch as thvd

    hvd.init()  # a second init is a no-op
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_size()) == (0, 1, 0, 1)
    assert hvd.backend_name() == "gloo" and hvd.is_homogeneous()
    assert not hvd.mpi_threads_supported() and hvd.gloo_enabled() and not hvd.mpi_enabled()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(hvd.allreduce(x), x)
    np.testing.assert_array_equal(hvd.allgather(x), x)
    np.testing.assert_array_equal(thvd.allreduce(torch.from_numpy(x), op=thvd.Sum), x)
    assert thvd.join() == 0
    with pytest.raises(CollectiveError, match="writable"):
        hvd.allreduce_(x.T)


def test_distributed_optimizer_alone_equals_the_plain_optimizer(single_process):
    import torch

    import spark_estimators.collective.torch as thvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = thvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.SGD)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for m, o in ((model, opt), (plain, plain_opt)):
        for _ in range(3):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ConfigurationError, match="already a DistributedOptimizer"):
        thvd.DistributedOptimizer(opt)
    with pytest.raises(ConfigurationError, match="does not name"):
        thvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=list(model.named_parameters())[:1],
        )


class LoopbackBackend(Backend):
    """A numpy-only backend for a job of one, shaped like the MPI backend will be."""

    name = "loopback"

    def start(self) -> None:
        self.calls: list[str] = []

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def allreduce(self, buf, op) -> None:
        self.calls.append(f"allreduce:{op.name}")
        np.asarray(buf)[...] *= 1  # touches the memory the way a real backend would

    def allgather(self, buf, first_dims):
        self.calls.append("allgather")
        return np.array(np.asarray(buf), copy=True)

    def broadcast(self, buf, root) -> None:
        self.calls.append("broadcast")

    def alltoall(self, buf, send_rows, recv_rows):
        self.calls.append("alltoall")
        return np.array(np.asarray(buf), copy=True)

    def barrier(self) -> None:
        self.calls.append("barrier")


def test_a_numpy_only_backend_serves_the_core_and_the_torch_adapter(clean_env):
    import torch

    import spark_estimators.collective.runtime.engine as engine
    import spark_estimators.collective.torch as thvd

    register_backend("loopback", LoopbackBackend)
    hvd.init(backend="loopback")
    try:
        backend = engine.require("test").backend
        assert hvd.backend_name() == "loopback"
        np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum), np.ones(3))
        gathered = thvd.allgather(torch.arange(4.0))
        assert isinstance(gathered, torch.Tensor) and gathered.tolist() == [0, 1, 2, 3]
        received, splits = thvd.alltoall(torch.arange(3), splits=[3])
        assert received.tolist() == [0, 1, 2] and splits.tolist() == [3]
        assert thvd.reducescatter(torch.ones(2, 2), op=thvd.Sum).tolist() == [[1, 1], [1, 1]]
        assert thvd.allgather_object({"a": 1}) == [{"a": 1}]
        assert thvd.broadcast_object("x") == "x"
        assert "allreduce:SUM" in backend.calls and "alltoall" in backend.calls
    finally:
        hvd.shutdown()
    assert backend.calls[-1] == "shutdown"
    assert not hvd.is_initialized()


def test_topology_validation():
    with pytest.raises(ConfigurationError, match="local_rank=2"):
        Topology(rank=0, size=2, local_rank=2, local_size=2)


def test_inline_limit(clean_env):
    clean_env.delenv(ev.INLINE_LIMIT, raising=False)
    # Default: a round gathers at most 1 MiB, and one rank sends at most 256 KiB.
    assert settings.inline_limit(2) == 256 * 1024
    assert settings.inline_limit(16) == 64 * 1024
    clean_env.setenv(ev.INLINE_LIMIT, "4096")
    assert settings.inline_limit(2) == 4096
    assert settings.inline_limit(2, 100) == 100
    clean_env.setenv(ev.INLINE_LIMIT, "lots")
    with pytest.raises(ConfigurationError, match="SPARK_ESTIMATORS_INLINE_LIMIT='lots'"):
        settings.inline_limit(2)
    with pytest.raises(ConfigurationError, match="inline limit must be >= 0 bytes.*-1"):
        settings.inline_limit(2, -1)
