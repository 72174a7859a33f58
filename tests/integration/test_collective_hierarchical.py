"""Hierarchical allreduce/allgather (HOROVOD_HIERARCHICAL_*) with real rank processes (gloo).

Each rank process says which "host" it is on through ``SPARK_ESTIMATORS_HOSTNAME`` (the host
hash the launchers set; DECISIONS.md) and its local/cross numbers before ``init()``, so one
machine holds several hosts. In each launch the same ops run hierarchically and flat (the
wrapper's switches, flipped on every rank between ops) and the tests compare them: bit for bit
for integer dtypes and integer-valued floats, within rounding for random floats, and against
numpy references. Two layouts: 2 hosts x 2 ranks (contiguous; reduce-scatter path) and 3 ranks
on hosts A, B, A (uneven and not contiguous; roots path, allgather rows put back in rank order).
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def _data(rank: int, dtype: str, n: int):
    import torch

    rng = np.random.default_rng(7 * rank + len(dtype))
    if dtype == "bool":
        return torch.from_numpy(rng.random(n) < 0.3)
    values = rng.integers(-20 if not dtype.startswith("u") else 0, 20, size=n)
    if dtype.startswith("complex"):
        return torch.from_numpy((values + 1j * values[::-1]).astype(dtype))
    return torch.tensor(values).to(getattr(torch, dtype))


def _suite(hosts: list[str]) -> dict:
    import os

    import torch

    from spark_estimators import envvars as ev

    rank, size = int(os.environ[ev.SE_RANK]), int(os.environ[ev.SE_SIZE])
    order = list(dict.fromkeys(hosts))
    mine = [r for r in range(size) if hosts[r] == hosts[rank]]
    os.environ[ev.SE_HOSTNAME] = hosts[rank]
    os.environ[ev.SE_LOCAL_RANK] = str(mine.index(rank))
    os.environ[ev.SE_LOCAL_SIZE] = str(len(mine))
    os.environ[ev.SE_CROSS_RANK] = str(order.index(hosts[rank]))
    os.environ[ev.SE_CROSS_SIZE] = str(len(order))

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init()
    backend = eng.current().backend
    out: dict = {
        "wrapper": type(backend).__name__,
        "local": backend.local.size,
        "cross": None if backend.cross is None else backend.cross.size,
        "native_average": backend.native_average,
    }

    assert backend.scatter is False  # gloo: the roots' path by default

    def both(fn, scatter=False):
        """fn() hierarchically, then flat (the same op on every rank in the same order)."""
        backend.allreduce_on = backend.allgather_on = True
        backend.scatter = scatter  # the reduce-scatter path (NCCL's) runs on gloo too
        hier = fn()
        backend.allreduce_on = backend.allgather_on = backend.scatter = False
        flat = fn()
        backend.allreduce_on = backend.allgather_on = True
        return hier, flat

    def same(pair) -> bool:
        a, b = pair
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    exact = {}
    for dtype in [*INT_DTYPES, *FLOAT_DTYPES, "bool"]:
        for n in (1001,):  # odd: the reduce-scatter path pads (the even case: int_sum_ok below)
            ops = [hvd.Sum] if dtype.startswith("complex") or dtype == "bool" else [
                hvd.Sum, hvd.Min, hvd.Max]  # fmt: skip
            for op in ops:
                x = _data(rank, dtype, n)
                for scatter in (False, True):
                    pair = both(lambda x=x, op=op: hvd.allreduce(x, op=op), scatter)
                    exact[f"{dtype}/{n}/{op}/{scatter}"] = same(pair)
    out["exact"] = exact
    # Results against numpy references (every rank's data is known here).
    x = torch.arange(1000, dtype=torch.int64) * (rank + 1)
    expected = torch.arange(1000) * sum(range(1, size + 1))
    out["int_sum_ok"] = all(bool((t == expected).all()) for t in both(
        lambda: hvd.allreduce(x, op=hvd.Sum), scatter=True))  # fmt: skip
    out["int_avg"] = same(both(lambda: hvd.allreduce(x, op=hvd.Average)))
    p = torch.full((600,), 2 + rank, dtype=torch.int64)
    out["product"] = hvd.allreduce(p, op=hvd.Product)[:2].tolist()
    rng = np.random.default_rng(rank)
    f = torch.from_numpy(rng.standard_normal(3000))
    hier, flat = both(lambda: hvd.allreduce(f, op=hvd.Average))
    scattered, _ = both(lambda: hvd.allreduce(f, op=hvd.Average), scatter=True)
    out["float_avg_close"] = bool(torch.allclose(hier, flat, rtol=1e-12, atol=1e-12))
    out["float_avg_close"] &= bool(torch.allclose(scattered, flat, rtol=1e-12, atol=1e-12))
    out["float_avg"] = hier[:3].tolist() + scattered[:3].tolist()
    # Scaling, in place, grouped and async forms take the same path.
    g = [torch.full((700,), float(rank)), torch.full((300,), 1.0)]
    out["grouped"] = [t[0].item() for t in hvd.grouped_allreduce(g, op=hvd.Sum)]
    handles = [hvd.allreduce_async_(torch.full((500,), float(i + rank)), op=hvd.Sum)
               for i in range(5)]  # fmt: skip
    out["async"] = [hvd.synchronize(h)[0].item() for h in handles]
    out["prescaled"] = hvd.allreduce(torch.ones(900), op=hvd.Sum, prescale_factor=0.5,
                                     postscale_factor=3.0)[0].item()  # fmt: skip
    # Allgather: uneven first dimensions, rank order kept.
    rows = torch.arange(rank + 1, dtype=torch.float32).reshape(-1, 1) + 10 * rank
    out["allgather"] = same(both(lambda: hvd.allgather(rows)))
    out["allgather_rows"] = hvd.allgather(rows).flatten().tolist()
    wide = torch.full((rank + 2, 3), rank, dtype=torch.int16)
    out["allgather_int16"] = same(both(lambda: hvd.allgather(wide)))
    empty = torch.zeros((0, 2))
    out["allgather_empty"] = list(hvd.allgather(empty).shape)
    # Adasum reduces through allgather (power-of-two sizes only, as in Horovod).
    a = torch.from_numpy(np.random.default_rng(50 + rank).standard_normal(800))
    if size & (size - 1) == 0:
        hier, flat = both(lambda: hvd.allreduce(a, op=hvd.Adasum))
        out["adasum_close"] = bool(torch.allclose(hier, flat, rtol=1e-12, atol=1e-12))
    # A process set spanning both hosts: built hierarchically as well.
    ps = hvd.add_process_set(list(range(size)) if size < 4 else [0, 1, 2])
    if ps.included():
        s = eng.require("x", ps).backend
        out["set_wrapper"] = type(s).__name__
        out["set_sum"] = hvd.allreduce(torch.full((1000,), float(rank)), op=hvd.Sum,
                                       process_set=ps)[0].item()  # fmt: skip
        out["set_gather"] = hvd.allgather(torch.tensor([rank]), process_set=ps).tolist()
    # Join: the last rank joins at once; the others' allreduces still divide by size.
    if rank == size - 1:
        out["join"] = hvd.join()
    else:
        out["joined_avg"] = hvd.allreduce(torch.full((2000,), 6.0), op=hvd.Average)[0].item()
        out["join"] = hvd.join()
    hvd.shutdown()
    return out


ENV = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
       "SPARK_ESTIMATORS_INLINE_LIMIT": "0"}  # fmt: skip


@pytest.fixture(scope="module", params=[["a", "a", "b", "b"], ["a", "b", "a"]], ids=["2x2", "ABA"])
def layout(request):
    hosts = request.param
    results = run_local(_suite, num_proc=len(hosts), args=(hosts,), env=ENV, backend="gloo")
    return hosts, results


def test_the_backend_is_wrapped_with_local_and_cross_groups(layout):
    hosts, results = layout
    for r, out in enumerate(results):
        assert out["wrapper"] == "HierarchicalBackend"
        assert out["local"] == hosts.count(hosts[r])
        assert out["native_average"] is False  # Average = sum, then the engine scales
    if hosts == ["a", "b", "a"]:
        assert [out["cross"] for out in results] == [2, 2, None]  # roots: ranks 0 and 1


def test_integer_and_exact_float_sums_equal_flat_bit_for_bit(layout):
    _, results = layout
    for out in results:
        bad = [k for k, ok in out["exact"].items() if not ok]
        assert not bad, bad
        assert len(out["exact"]) == 2 * (3 * 8 + 3 * 4 + 2 + 1)
        assert out["int_sum_ok"] and out["int_avg"]


def test_values_match_references(layout):
    hosts, results = layout
    size = len(hosts)
    for r, out in enumerate(results):
        assert out["product"] == [float(np.prod([2 + k for k in range(size)]))] * 2
        assert out["float_avg_close"]
        assert out["float_avg"] == results[0]["float_avg"]  # every rank: the same bits
        assert out["grouped"] == [float(sum(range(size))), float(size)]
        assert out["async"] == [float(size * i + sum(range(size))) for i in range(5)]
        assert out["prescaled"] == pytest.approx(size * 0.5 * 3.0)
        assert out["allgather"] and out["allgather_int16"]
        assert out["allgather_rows"] == [10.0 * k + j for k in range(size) for j in range(k + 1)]
        assert out["allgather_empty"] == [0, 2]
        assert out.get("adasum_close", size == 3)
        assert out["join"] == size - 2  # the others join together, last: the highest
        if r != size - 1:
            assert out["joined_avg"] == pytest.approx(6.0 * (size - 1) / size)


def test_process_set_across_hosts_is_hierarchical(layout):
    hosts, results = layout
    members = [0, 1, 2]
    for r, out in enumerate(results):
        if r not in members:
            assert "set_sum" not in out
            continue
        assert out["set_wrapper"] == "HierarchicalBackend"
        assert out["set_sum"] == float(sum(members))
        assert out["set_gather"] == members
