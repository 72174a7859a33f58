"""CUDA tensors through the paths issues 25 and 31 changed (skipped without CUDA).

One GPU is enough: NCCL runs a job of one, and Gloo runs two ranks that share ``cuda:0`` (Gloo
takes CUDA tensors; NCCL refuses two ranks on one GPU). Covered: fused async allreduces, the
dtypes Gloo and NCCL lack (int16, bool, bfloat16, ...), autograd through grouped ops,
``SyncBatchNorm`` and the BatchNorm running-statistics average.
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


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_gpu_count() == 0, reason="needs a CUDA device; none here"),
]

DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def _paths() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.torch.running_stats import average_running_stats, running_stat_buffers

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cuda", 0)
    out: dict = {"backend": hvd.backend_name(), "size": n}

    # 100 per-tensor async allreduces, then synchronize: fused by the engine.
    tensors = [torch.full((1024,), float(r + i), device=dev) for i in range(100)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"t{i}") for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)
    out["async_sums"] = [float(t[0]) for t in tensors]
    out["async_on_cuda"] = all(t.is_cuda for t in tensors)

    # Every dtype: allgather and broadcast; allreduce for the numeric ones.
    dtypes = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        x = (torch.arange(3, device=dev) + r).to(dt)
        g = hvd.allgather(x, name=f"gather.{name}")
        b = hvd.broadcast(x, root_rank=0, name=f"bcast.{name}")
        s = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{name}")
        dtypes[name] = {
            "dtype_kept": g.dtype == dt and b.dtype == dt and s.dtype == dt,
            "on_cuda": g.is_cuda and b.is_cuda and s.is_cuda,
            "gather": g.float().cpu().tolist(),
            "bcast": b.float().cpu().tolist(),
            "sum": s.float().cpu().tolist(),
        }
    flags = torch.tensor([r == 0, True], device=dev)
    dtypes["bool"] = {"gather": hvd.allgather(flags, name="gather.bool").cpu().tolist()}
    out["dtypes"] = dtypes

    # Autograd through grouped_allreduce (Sum): d(sum over ranks)/dx = size on every rank.
    xs = [torch.ones(4, device=dev, requires_grad=True) for _ in range(2)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grouped.grad")
    sum(y.sum() for y in ys).backward()
    out["grouped_grads"] = [x.grad.cpu().tolist() for x in xs]

    # SyncBatchNorm: each rank's half of a global batch gives the full batch's normalisation.
    torch.manual_seed(0)
    full = torch.randn(8, 3, device=dev) * 3 + 1
    sbn = hvd.SyncBatchNorm(3).to(dev)
    part = full[r * 8 // n : (r + 1) * 8 // n]
    y = sbn(part)
    ref = torch.nn.functional.batch_norm(full, None, None, training=True)
    out["syncbn_max_diff"] = float((y - ref[r * 8 // n : (r + 1) * 8 // n]).abs().max())
    out["syncbn_running_mean"] = sbn.running_mean.cpu().tolist()

    # The BatchNorm running-statistics average on CUDA buffers.
    bn = torch.nn.BatchNorm1d(3).to(dev)
    with torch.no_grad():
        bn.running_mean.fill_(float(r))
        bn.running_var.fill_(float(2 * r + 1))
    count = average_running_stats(bn, lambda flat: hvd.allreduce_(flat, op=hvd.Sum), n)
    out["avg_count"] = count
    out["avg_on_cuda"] = all(b.is_cuda for b in running_stat_buffers(bn))
    out["avg_mean"] = bn.running_mean.cpu().tolist()
    out["avg_var"] = bn.running_var.cpu().tolist()
    hvd.shutdown()
    return out


def _check(results: list[dict], backend: str) -> None:
    n = len(results)
    for r, res in enumerate(results):
        assert res["backend"] == backend and res["size"] == n
        assert res["async_on_cuda"]
        assert res["async_sums"] == [float(sum(q + i for q in range(n))) for i in range(100)]
        for name in DTYPES:
            d = res["dtypes"][name]
            assert d["dtype_kept"] and d["on_cuda"], name
            assert d["gather"] == [float(q + k) for q in range(n) for k in range(3)], name
            assert d["bcast"] == [0.0, 1.0, 2.0], name
            assert d["sum"] == [float(sum(q + k for q in range(n))) for k in range(3)], name
        assert res["dtypes"]["bool"]["gather"] == [v for q in range(n) for v in (q == 0, True)]
        assert res["grouped_grads"] == [[float(n)] * 4, [float(n)] * 4]
        assert res["syncbn_max_diff"] < 1e-4
        assert res["syncbn_running_mean"] == results[0]["syncbn_running_mean"]
        mean = sum(range(n)) / n
        var = sum(2 * q + 1 for q in range(n)) / n
        assert res["avg_count"] == 2 and res["avg_on_cuda"]
        np.testing.assert_allclose(res["avg_mean"], [mean] * 3)
        np.testing.assert_allclose(res["avg_var"], [var] * 3)
        assert r < n


def test_cuda_paths_nccl_job_of_one():
    _check(run_local(_paths, num_proc=1, backend="nccl"), "nccl")


def test_cuda_paths_gloo_two_ranks_sharing_one_gpu():
    _check(run_local(_paths, num_proc=2, backend="gloo"), "gloo")
