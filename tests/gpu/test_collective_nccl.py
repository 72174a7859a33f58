"""The NCCL backend on real GPUs (skipped without CUDA).

NCCL refuses two ranks on one GPU, so one GPU runs a job of one (the NCCL code path, the
Gloo half for CPU tensors and objects, DistributedOptimizer on CUDA), and two GPUs run 2 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.launch import run_local


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device for the NCCL backend; none here"),
]


def _nccl_suite() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(6.0, device=dev).reshape(2, 3) + r
    out = {"backend": hvd.backend_name(), "size": n, "device_type": dev.type}
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).cpu().numpy()
    out["avg_fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16).cpu().numpy()
    out["grouped"] = [t.cpu().numpy() for t in hvd.grouped_allreduce([x, x.double()], op=hvd.Sum)]
    out["gather"] = hvd.allgather(torch.full((r + 1, 2), float(r), device=dev)).cpu().numpy()
    out["bcast"] = hvd.broadcast(x, root_rank=0).cpu().numpy()
    out["a2a"] = hvd.alltoall(torch.arange(2 * n, device=dev) + 100 * r).cpu().numpy()
    out["cpu_over_gloo"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy()
    out["objects"] = hvd.allgather_object(r)
    try:
        hvd.allreduce(torch.ones(2 + r, device=dev), name="gpu.w")
        out["mismatch"] = None
    except Exception as exc:
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(
        dev
    )
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(3, 4 * n, 4, generator=gen), torch.randn(3, 4 * n, 1, generator=gen)
    for step in range(3):
        xb, yb = xs[step].to(dev), ys[step].to(dev)
        torch.nn.functional.mse_loss(model(xb[4 * r : 4 * r + 4]), yb[4 * r : 4 * r + 4]).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xb), yb).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out["max_weight_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters())
    )
    hvd.shutdown()
    return out


def _check(results: list[dict]) -> None:
    n = len(results)
    base = np.arange(6.0).reshape(2, 3)
    total = sum(base + r for r in range(n))
    for r, res in enumerate(results):
        assert res["backend"] == "nccl" and res["size"] == n and res["device_type"] == "cuda"
        np.testing.assert_allclose(res["sum"], total)
        np.testing.assert_allclose(res["avg_fp16"], total / n, rtol=1e-3)
        np.testing.assert_allclose(res["grouped"][0], total)
        np.testing.assert_allclose(res["grouped"][1], total)
        gathered = np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)])
        np.testing.assert_array_equal(res["gather"], gathered)
        np.testing.assert_array_equal(res["bcast"], base)
        expected = np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)])
        np.testing.assert_array_equal(res["a2a"], expected)
        np.testing.assert_array_equal(res["cpu_over_gloo"], np.full(2, float(n)))
        assert res["objects"] == list(range(n))
        assert res["max_weight_diff"] < 1e-5
        if n > 1:
            assert "CollectiveError" in res["mismatch"] and "'gpu.w'" in res["mismatch"]


def test_nccl_job_of_one_gpu():
    _check(run_local(_nccl_suite, num_proc=1, backend="nccl"))


@pytest.mark.skipif(GPUS < 2, reason="two ranks need two GPUs (NCCL refuses to share one)")
def test_nccl_two_ranks():
    _check(run_local(_nccl_suite, num_proc=2, backend="nccl"))
