"""Issue 25, items 2, 3, 5 and 6: what horovod's own tests expect, with 2 real ranks on 127.0.0.1.

* Adasum at extreme magnitudes (horovod test_adasum_pytorch.py ``test_stability`` and
  ``test_stability_2``, and float64 vectors scaled by 1e-160 / 1e160);
* every dtype horovod's test_torch.py uses (and the other torch integer dtypes) through Gloo,
  for every op, with wrap-around and unsigned order checked against numpy, and a refused op
  that leaves the group usable;
* autograd through grouped_allreduce, alltoall, reducescatter, grouped_allgather,
  grouped_reducescatter (and allgather / broadcast), with the gradients of horovod's
  ``*_grad`` tests;
* ``DistributedOptimizer(process_set=s)`` on a rank outside ``s`` trains locally;
* ``grouped_allgather``, ``grouped_reducescatter`` and ``sparse_allreduce_async`` values.

One launch runs ``_suite`` on both ranks and returns what each saw; the tests assert on it.
``SPARK_ESTIMATORS_INLINE_LIMIT=0`` keeps small allreduces off the negotiation's inline path,
so every reduction goes through Gloo.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from spark_estimators.launch import run_local

SIZE = 2
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

INT_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
DTYPES = [*INT_DTYPES, *FLOAT_DTYPES, "bool"]
ROWS = 200
SPLITS = [[50, 150], [120, 80]]  # alltoall rows each rank sends to ranks 0 and 1
REDUCTIONS = ["Sum", "Min", "Max", "Product"]
GRAD_DTYPES = ["float32", "float64"]
DIMS = [1, 2, 3]


def _dtype_data(dtype: str, rank: int) -> np.ndarray:
    """(ROWS, 3) values of ``dtype`` (as numpy; bfloat16 as float32) for one rank.

    Integers hold the type's extremes, so sums and products wrap around and unsigned order
    matters (uint64 above 2**63); floats hold small integers, exact in float16 and bfloat16.
    600 elements are more than the negotiation's fixed inline room (512 bytes), so every
    reduction goes through Gloo, not the inline numpy path.
    """
    base = np.arange(ROWS * 3).reshape(ROWS, 3) * (rank + 1)
    if dtype == "bool":
        return base % (rank + 2) == 0
    if dtype in FLOAT_DTYPES:
        return (base % 17 - 5).astype(np.float32 if dtype == "bfloat16" else dtype)
    info = np.iinfo(dtype)
    data = base.astype(dtype)
    data[0, 0] = info.max - rank
    data[0, 1] = info.min + rank
    data[1, 0] = info.max // 2 + 3 * rank
    return data


def _grad_tensor(torch, dtype: str, dim: int, rows: int | None = None):
    shape = [17] * dim if rows is None else [rows] + [17] * (dim - 1)
    return torch.ones(shape, dtype=getattr(torch, dtype))


def _dtype_section(hvd, torch, rank: int) -> dict:
    def tensor(dtype: str):
        data = torch.from_numpy(_dtype_data(dtype, rank).copy())
        return data.to(getattr(torch, dtype))

    def host(t):
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()

    out: dict = {}
    for dtype in DTYPES:
        res: dict = {}
        t = tensor(dtype)
        try:
            res["allgather"] = host(hvd.allgather(t[: rank + 1]))  # uneven first dimension
            res["broadcast"] = host(hvd.broadcast(t, root_rank=1))
            b = tensor(dtype)
            hvd.broadcast_(b, root_rank=0)
            res["broadcast_"] = host(b)
            received, splits = hvd.alltoall(t, splits=SPLITS[rank])
            res["alltoall"], res["alltoall_splits"] = host(received), splits.numpy()
            for op in REDUCTIONS:
                res[op] = host(hvd.allreduce(t, op=getattr(hvd, op)))
            pair = hvd.grouped_allreduce([t, t[1:]], op=hvd.Sum)
            res["grouped"] = [host(p) for p in pair]
            res["reducescatter"] = host(hvd.reducescatter(t, op=hvd.Sum))
            res["dtype_kept"] = hvd.allreduce(t, op=hvd.Max).dtype == t.dtype
        except Exception as exc:  # the tests report it per dtype
            res["error"] = f"{type(exc).__name__}: {exc}"
        out[dtype] = res
    # A refused op is refused before anything is sent: the group stays usable afterwards.
    try:
        hvd.allreduce(torch.ones(ROWS, dtype=torch.complex64), op=hvd.Min)  # not inline
        out["complex_min"] = "no error"
    except Exception as exc:
        out["complex_min"] = f"{type(exc).__name__}: {exc}"
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128) * (rank + 1)
    try:
        out["complex_sum"] = hvd.allreduce(z, op=hvd.Sum).numpy()
        out["after"] = hvd.allreduce(torch.ones(3) * (rank + 1), op=hvd.Sum).numpy()
    except Exception as exc:
        out["complex_sum"] = out["after"] = f"{type(exc).__name__}: {exc}"
    return out


def _adasum_section(hvd, torch, rank: int) -> dict:
    """Horovod's test_stability and test_stability_2 (CPU), and float64 at 1e-160 / 1e160."""
    size = hvd.size()
    out: dict = {}
    for data_type in (np.float32, np.float16):
        np.random.seed(2)
        n = 1024
        a = np.random.normal(0, np.finfo(data_type).tiny, (n, 1)).astype(np.float64)
        r = np.random.normal(0, 1, (size, 1)).astype(np.float64)
        q = np.dot(a, r.T).astype(data_type).astype(np.float64)
        tensor = torch.from_numpy(q[:, rank].astype(data_type))
        hvd.allreduce_(tensor, op=hvd.Adasum)
        out[f"stability_{np.dtype(data_type).name}"] = (tensor.numpy(), np.sum(q, axis=1) / size)

        np.random.seed(2)
        dt_min = np.finfo(data_type).tiny.astype(np.float64)
        dt_max = math.sqrt(np.finfo(data_type).max.astype(np.float64))
        a = np.random.normal(0, 1, (n, 1)).astype(np.float64)
        r = np.array(
            [dt_max ** ((i + 1) / size) * dt_min ** ((size - i - 1) / size) for i in range(size)]
        ).reshape(size, 1)
        np.random.shuffle(r)
        q = np.dot(a, r.T).astype(data_type).astype(np.float64)
        tensor = torch.from_numpy(q[:, rank].astype(data_type))
        hvd.allreduce_(tensor, op=hvd.Adasum)
        out[f"stability_2_{np.dtype(data_type).name}"] = (
            tensor.numpy(),
            np.sum(q, axis=1) / size,
        )
    rng = np.random.default_rng(7)
    direction = rng.standard_normal(1000)
    for scale in (1e-160, 1e160):
        mine = torch.from_numpy(direction * scale * (rank + 1))  # parallel: the average
        out[f"float64_{scale:g}"] = hvd.allreduce(mine, op=hvd.Adasum).numpy()
    return out


def _grad_section(hvd, torch, rank: int) -> dict:
    """The gradients of horovod's test_torch.py ``*_grad`` tests, case by case."""
    size = hvd.size()
    out: dict = {}
    for dtype, dim in itertools.product(GRAD_DTYPES, DIMS):
        key = f"{dtype}-{dim}"
        tdt = getattr(torch, dtype)
        torch.manual_seed(1234)
        # grouped_allreduce, Sum and Average (backward output by output, as horovod does)
        for op in ("Sum", "Average"):
            ts = [torch.empty([17] * dim).random_(-100, 100).to(tdt) for _ in range(5)]
            for t in ts:
                t.requires_grad_()
            for s in hvd.grouped_allreduce(ts, op=getattr(hvd, op)):
                s.backward(_grad_tensor(torch, dtype, dim))
            out[f"grouped_allreduce_{op}-{key}"] = [t.grad.numpy() for t in ts]
        # alltoall with splits, and even
        vals = [i for i in range(size) for _ in range(rank + 1)]
        t = torch.tensor(vals, dtype=tdt)
        for _ in range(dim - 1):
            t = torch.cat((t.unsqueeze(1), t.unsqueeze(1)), dim=1)
        t.requires_grad_()
        collected, received = hvd.alltoall(t, torch.tensor([rank + 1] * size, dtype=torch.int32))
        collected.backward(torch.ones(collected.shape, dtype=tdt))
        out[f"alltoall-{key}"] = (t.grad.numpy(), received.numpy(), received.requires_grad)
        t2 = t.detach().clone().requires_grad_()
        collected = hvd.alltoall(t2)
        collected.backward(torch.ones(collected.shape, dtype=tdt))
        out[f"alltoall_even-{key}"] = t2.grad.numpy()
        # reducescatter, Sum and Average, and with scale factors; grouped
        for op in ("Sum", "Average"):
            t = torch.empty([size * 4] * dim).random_(-100, 100).to(tdt).requires_grad_()
            summed = hvd.reducescatter(t, op=getattr(hvd, op))
            summed.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=tdt))
            out[f"reducescatter_{op}-{key}"] = t.grad.numpy()
        t = torch.empty([size * 4] * dim).random_(-100, 100).to(tdt).requires_grad_()
        scaled = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        scaled.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=tdt))
        out[f"reducescatter_scaled-{key}"] = t.grad.numpy()
        ts = [
            torch.empty([size * 4] * dim).random_(-100, 100).to(tdt).requires_grad_()
            for _ in range(5)
        ]
        for s in hvd.grouped_reducescatter(ts, op=hvd.Sum):
            s.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=tdt))
        out[f"grouped_reducescatter-{key}"] = [t.grad.numpy() for t in ts]
        # allgather and grouped_allgather (uneven first dimensions 3 and 2)
        sizes = [3, 2, 7, 4, 6, 8, 10][:size]
        grad_ys = torch.cat(
            [torch.ones([n] + [17] * (dim - 1), dtype=tdt) * r for r, n in enumerate(sizes)]
        )
        t = (torch.ones([sizes[rank]] + [17] * (dim - 1)) * rank).to(tdt).requires_grad_()
        hvd.allgather(t).backward(grad_ys)
        out[f"allgather-{key}"] = t.grad.numpy()
        ts = [
            (torch.ones([sizes[rank]] + [17] * (dim - 1)) * rank).to(tdt).requires_grad_()
            for _ in range(5)
        ]
        for g in hvd.grouped_allgather(ts):
            g.backward(grad_ys)
        out[f"grouped_allgather-{key}"] = [t.grad.numpy() for t in ts]
        # broadcast from every root
        for root in range(size):
            t = (torch.ones([17] * dim) * rank).to(tdt).requires_grad_()
            hvd.broadcast(t, root).backward(_grad_tensor(torch, dtype, dim))
            out[f"broadcast_root{root}-{key}"] = t.grad.numpy()
    return out


def _optimizer_section(hvd, torch, rank: int, first: object) -> dict:
    """DistributedOptimizer(process_set={0}) on both ranks: rank 1 is outside the set."""
    out: dict = {}
    for op in ("Average", "Adasum"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            dist = hvd.DistributedOptimizer(
                opt, named_parameters=model.named_parameters(), process_set=first,
                op=getattr(hvd, op),
            )  # fmt: skip
            for step in range(2):
                dist.zero_grad()
                x = torch.arange(6.0).reshape(2, 3) * (rank + 1) + step
                model(x).pow(2).sum().backward()
                dist.step()
            out[op] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        except Exception as exc:
            out[op] = f"{type(exc).__name__}: {exc}"
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy()  # every rank is still in step
    return out


def _local_reference(rank: int) -> dict:
    """Two plain SGD steps on this rank's data alone."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        x = torch.arange(6.0).reshape(2, 3) * (rank + 1) + step
        model(x).pow(2).sum().backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _values_section(hvd, torch, rank: int) -> dict:
    out: dict = {}
    gathered = hvd.grouped_allgather(
        [torch.full((rank + 1, 2), float(rank)), torch.arange(3, dtype=torch.int64) + 10 * rank]
    )
    out["grouped_allgather"] = [g.numpy() for g in gathered]
    handle = hvd.grouped_allgather_async([torch.ones(1, dtype=torch.int16) * (rank + 7)])
    out["grouped_allgather_async"] = hvd.synchronize(handle)[0].numpy()
    scattered = hvd.grouped_reducescatter(
        [torch.arange(8.0).reshape(4, 2) * (rank + 1), torch.arange(6.0) + rank], op=hvd.Sum
    )
    out["grouped_reducescatter"] = [s.numpy() for s in scattered]
    handle = hvd.grouped_reducescatter_async([torch.arange(4.0) * (rank + 1)])
    out["grouped_reducescatter_async"] = hvd.synchronize(handle)[0].numpy()
    import spark_estimators.collective as core  # the numpy API goes through the same backend

    out["numpy_int16"] = core.allgather(np.full(2, rank + 1, np.int16))
    out["numpy_uint16_sum"] = core.allreduce(np.full(300, 60000, np.uint16), op=core.Sum)
    sparse = torch.sparse_coo_tensor([[rank, 2]], [1.0 + rank, 10.0], (4,))
    handle = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Average)
    out["sparse"] = handle().to_dense().numpy()
    out["sparse_sum"] = hvd.synchronize(hvd.sparse_allreduce_async(sparse, op=hvd.Sum))
    out["sparse_sum"] = out["sparse_sum"].to_dense().numpy()
    return out


FACTOR = float(np.random.RandomState(1234).uniform())  # horovod's scaling tests' factor
SCALED_DTYPES = ["float16", "float32", "int32", "int64"]


def _scaling_base(n: int):
    import torch

    return torch.empty(n).random_(-100, 100, generator=torch.Generator().manual_seed(1234))


def _scaling_section(hvd, torch, rank: int) -> dict:
    """horovod's allreduce prescale/postscale/average tests, inline (17) and through Gloo (1000)."""
    out: dict = {}
    for n, dtype in itertools.product((17, 1000), SCALED_DTYPES):
        t = _scaling_base(n).to(getattr(torch, dtype))
        out[n, dtype, "pre"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=FACTOR).numpy()
        out[n, dtype, "post"] = hvd.allreduce(t, op=hvd.Sum, postscale_factor=FACTOR).numpy()
        out[n, dtype, "avg"] = hvd.allreduce(t * (rank + 1), op=hvd.Average).numpy()
    return out


SPARSE_INPUTS = [[[1, 2, 4, 5], [4, 3, 2, 9]], [[1, 3, 4], [4, 7, 9]]]  # horovod's, per rank


def _sparse_section(hvd, torch, rank: int) -> dict:
    """horovod's test_sparse_embeddings with values: an Embedding(sparse=True) trained one step."""
    out: dict = {}
    for as_dense in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dist = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), sparse_as_dense=as_dense
        )
        dist.zero_grad()
        model(torch.tensor(SPARSE_INPUTS[rank])).sum().backward()
        dist.step()
        out[as_dense] = {
            "weight": model.weight.detach().numpy().copy(),
            "grad_is_sparse": model.weight.grad.is_sparse,
            "names": sorted(dist._parameter_names.values()),
        }
    # horovod's test_synchronize_step_warning: step() after synchronize() warns, in its words
    model = torch.nn.Linear(1, 1)
    dist = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.zeros(1, 1)).sum().backward()
    dist.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.step()
    out["step_warning"] = [str(w.message) for w in caught]
    # horovod's test_horovod_grouped_allreduce_cpu_gpu_error: tensors on two devices are refused
    # before anything is sent ("meta" stands in for a GPU here)
    try:
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2, device="meta")])
        out["two_devices"] = None
    except RuntimeError as exc:
        out["two_devices"] = (isinstance(exc, hvd.HorovodInternalError), str(exc))
    # horovod raises its HorovodInternalError (a RuntimeError) for a reducescatter with Adasum
    try:
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)
        out["rs_adasum"] = None
    except RuntimeError as exc:
        out["rs_adasum"] = (isinstance(exc, hvd.HorovodInternalError), str(exc))
    return out


def _suite() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd

    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first])
    rank = hvd.rank()
    out: dict = {}
    # Each section's failure is reported by its own tests; the dtypes run last because a dtype
    # Gloo refuses used to break the group for every later op.
    for section, fn in (
        ("adasum", _adasum_section),
        ("grads", _grad_section),
        ("values", _values_section),
        ("sparse", _sparse_section),
        ("scaling", _scaling_section),
        ("optimizer", lambda hvd, torch, rank: _optimizer_section(hvd, torch, rank, first)),
        ("dtypes", _dtype_section),
    ):
        try:
            out[section] = fn(hvd, torch, rank)
        except Exception as exc:
            out[section] = f"{type(exc).__name__}: {exc}"
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_local(
        _suite, num_proc=SIZE, backend="gloo", env={"SPARK_ESTIMATORS_INLINE_LIMIT": "0"}
    )


def _section(ranks, name: str) -> list[dict]:
    sections = [out[name] for out in ranks]
    for r, section in enumerate(sections):
        assert isinstance(section, dict), f"rank {r}: {section}"
    return sections


# -- item 2: Adasum ----------------------------------------------------------------------------
def _horovod_are_close(data_type, expected: np.ndarray, got: np.ndarray) -> bool:
    """Horovod's TorchAdasumTests.are_close."""
    ratio = np.linalg.norm(expected - got) / np.linalg.norm(expected) / 100.0
    return bool(ratio < np.finfo(data_type).eps)


@pytest.mark.parametrize("test", ["stability", "stability_2"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_adasum_stability_as_in_horovod(ranks, test, dtype):
    for r, section in enumerate(_section(ranks, "adasum")):
        got, expected = section[f"{test}_{dtype}"]
        assert got.dtype == np.dtype(dtype)
        assert _horovod_are_close(np.dtype(dtype), expected, got.astype(np.float64)), (
            f"rank {r}: off by {np.linalg.norm(expected - got) / np.linalg.norm(expected)}"
        )


@pytest.mark.parametrize("scale", [1e-160, 1e160])
def test_adasum_of_parallel_float64_vectors_at_extreme_scales_is_their_average(ranks, scale):
    direction = np.random.default_rng(7).standard_normal(1000)
    expected = direction * scale * 1.5  # the average of 1x and 2x the same vector
    for section in _section(ranks, "adasum"):
        got = section[f"float64_{scale:g}"]
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got / scale, expected / scale, rtol=1e-12)


# -- item 3: dtypes ----------------------------------------------------------------------------
def _as_numpy(dtype: str, data: np.ndarray) -> np.ndarray:
    return data.astype(np.float32) if dtype == "bfloat16" else data


def _reduce_reference(dtype: str, op: str) -> np.ndarray:
    a, b = (_dtype_data(dtype, r) for r in range(SIZE))
    if dtype == "bool":
        return {"Sum": a | b, "Min": a & b, "Max": a | b, "Product": a & b}[op]
    with np.errstate(over="ignore"):
        ref = {"Sum": a + b, "Min": np.minimum(a, b), "Max": np.maximum(a, b), "Product": a * b}
    return ref[op].astype(a.dtype)  # integer wrap-around, as the dtype itself does it


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_through_every_op(ranks, dtype):
    data = [_dtype_data(dtype, r) for r in range(SIZE)]
    for r, section in enumerate(_section(ranks, "dtypes")):
        res = section[dtype]
        assert "error" not in res, f"rank {r}: {res.get('error')}"
        assert res["dtype_kept"]
        np.testing.assert_array_equal(res["allgather"], np.concatenate([data[0][:1], data[1][:2]]))
        np.testing.assert_array_equal(res["broadcast"], data[1])
        np.testing.assert_array_equal(res["broadcast_"], data[0])
        lo = [sum(SPLITS[s][:r]) for s in range(SIZE)]
        hi = [lo[s] + SPLITS[s][r] for s in range(SIZE)]
        expected_rows = np.concatenate([data[s][lo[s] : hi[s]] for s in range(SIZE)])
        np.testing.assert_array_equal(res["alltoall"], expected_rows)
        np.testing.assert_array_equal(res["alltoall_splits"], [SPLITS[s][r] for s in range(SIZE)])
        for op in REDUCTIONS:
            np.testing.assert_array_equal(
                res[op], _reduce_reference(dtype, op), err_msg=f"{dtype} {op} on rank {r}"
            )
        total = _reduce_reference(dtype, "Sum")
        np.testing.assert_array_equal(res["grouped"][0], total)
        np.testing.assert_array_equal(res["grouped"][1], total[1:])
        half = ROWS // SIZE
        np.testing.assert_array_equal(res["reducescatter"], total[half * r : half * (r + 1)])


def test_uint64_order_and_int16_wraparound_are_those_of_the_dtype(ranks):
    res = _section(ranks, "dtypes")[0]
    assert res["uint64"]["Max"][0, 0] == np.iinfo(np.uint64).max  # above 2**63: unsigned order
    assert res["uint64"]["Min"][0, 1] == 0
    assert res["int16"]["Sum"][0, 0] == np.int16(-3)  # 32767 + 32766 wraps around


def test_a_refused_op_leaves_the_group_usable(ranks):
    for r, section in enumerate(_section(ranks, "dtypes")):
        assert section["complex_min"].startswith("ConfigurationError"), section["complex_min"]
        assert "complex" in section["complex_min"] and "op=Sum" in section["complex_min"]
        np.testing.assert_array_equal(section["complex_sum"], np.array([3 + 6j, 9 - 3j]))
        np.testing.assert_array_equal(section["after"], [3.0, 3.0, 3.0], err_msg=f"rank {r}")


# -- item 5: autograd --------------------------------------------------------------------------
def _close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Horovod's check: the norm of the difference below 1e-8."""
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    err = np.linalg.norm(expected - got)
    assert err < 1e-8, f"{what}: gradient {got.ravel()[:5]}... differs from {expected.ravel()[:5]}"


CASES = [f"{d}-{n}" for d, n in itertools.product(GRAD_DTYPES, DIMS)]


@pytest.mark.parametrize("case", CASES)
def test_grouped_allreduce_grad(ranks, case):
    dim = int(case.split("-")[1])
    for r, grads in enumerate(_section(ranks, "grads")):
        for op, factor in (("Sum", SIZE), ("Average", 1)):
            for g in grads[f"grouped_allreduce_{op}-{case}"]:
                _close(g, np.ones([17] * dim) * factor, f"rank {r} {op} {case}")


@pytest.mark.parametrize("case", CASES)
def test_alltoall_grad(ranks, case):
    for r, grads in enumerate(_section(ranks, "grads")):
        grad, received, received_requires_grad = grads[f"alltoall-{case}"]
        _close(grad, np.ones(grad.shape), f"rank {r} alltoall {case}")
        assert grad.shape[0] == SIZE * (r + 1)
        np.testing.assert_array_equal(received, [1, 2])
        assert not received_requires_grad
        even = grads[f"alltoall_even-{case}"]
        _close(even, np.ones(even.shape), f"rank {r} alltoall even {case}")


@pytest.mark.parametrize("case", CASES)
def test_reducescatter_grad(ranks, case):
    dim = int(case.split("-")[1])
    shape = [SIZE * 4] * dim
    for r, grads in enumerate(_section(ranks, "grads")):
        _close(grads[f"reducescatter_Sum-{case}"], np.ones(shape) * SIZE, f"rank {r} {case}")
        _close(grads[f"reducescatter_Average-{case}"], np.ones(shape), f"rank {r} {case}")
        _close(
            grads[f"reducescatter_scaled-{case}"], np.ones(shape) * SIZE * 1.5, f"rank {r} {case}"
        )
        for g in grads[f"grouped_reducescatter-{case}"]:
            _close(g, np.ones(shape) * SIZE, f"rank {r} grouped {case}")


@pytest.mark.parametrize("case", CASES)
def test_allgather_and_broadcast_grad(ranks, case):
    dim = int(case.split("-")[1])
    sizes = [3, 2]
    for r, grads in enumerate(_section(ranks, "grads")):
        expected = np.ones([sizes[r]] + [17] * (dim - 1)) * r
        _close(grads[f"allgather-{case}"], expected, f"rank {r} allgather {case}")
        for g in grads[f"grouped_allgather-{case}"]:
            _close(g, expected, f"rank {r} grouped_allgather {case}")
        for root in range(SIZE):
            expected = np.ones([17] * dim) * (1 if r == root else 0)
            _close(grads[f"broadcast_root{root}-{case}"], expected, f"rank {r} root {root}")


# -- item 6: DistributedOptimizer outside its process set --------------------------------------
@pytest.mark.parametrize("op", ["Average", "Adasum"])
def test_optimizer_on_a_rank_outside_its_process_set_trains_locally(ranks, op):
    for r, section in enumerate(_section(ranks, "optimizer")):
        got = section[op]
        assert isinstance(got, dict), f"rank {r}: {got}"
        reference = _local_reference(r)
        for k, v in reference.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=f"rank {r} {op} {k}")
        np.testing.assert_array_equal(section["after"], [2.0, 2.0])
    # the two ranks trained on different data: a silent allreduce would have made them equal
    first, second = (s[op]["weight"] for s in _section(ranks, "optimizer"))
    assert not np.allclose(first, second)


# -- item 4: the grouped ops and sparse_allreduce_async, by value -------------------------------
def test_grouped_allgather_and_reducescatter_values(ranks):
    for r, values in enumerate(_section(ranks, "values")):
        floats, ints = values["grouped_allgather"]
        np.testing.assert_array_equal(floats, [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
        np.testing.assert_array_equal(ints, [0, 1, 2, 10, 11, 12])
        np.testing.assert_array_equal(values["grouped_allgather_async"], [7, 8])
        assert values["grouped_allgather_async"].dtype == np.int16
        matrix, vector = values["grouped_reducescatter"]
        np.testing.assert_array_equal(matrix, (np.arange(8.0).reshape(4, 2) * 3)[2 * r : 2 * r + 2])
        np.testing.assert_array_equal(vector, (np.arange(6.0) * 2 + 1)[3 * r : 3 * r + 3])
        average = np.arange(4.0) * 1.5
        np.testing.assert_array_equal(
            values["grouped_reducescatter_async"], average[2 * r : 2 * r + 2]
        )


def test_sparse_allreduce_async_gathers_every_entry(ranks):
    for values in _section(ranks, "values"):
        # rank r holds {r: 1 + r, 2: 10}; the gathered entries sum per index when densified
        np.testing.assert_allclose(values["sparse"], np.array([1.0, 2.0, 20.0, 0.0]) / SIZE)
        np.testing.assert_allclose(values["sparse_sum"], [1.0, 2.0, 20.0, 0.0])


# -- DistributedOptimizer with sparse gradients (horovod's test_sparse_embeddings) ---------------
@pytest.mark.parametrize("as_dense", [False, True])
def test_sparse_gradients_are_averaged_like_dense_ones(ranks, as_dense):
    import torch

    torch.manual_seed(0)
    start = torch.nn.Embedding(10, 3).weight.detach().numpy()
    counts = [np.bincount(np.ravel(inp), minlength=10) for inp in SPARSE_INPUTS]
    average = (counts[0] + counts[1])[:, None] / SIZE * np.ones((1, 3))  # d(sum)/d(row) = count
    expected = start - 0.1 * average
    for r, section in enumerate(_section(ranks, "sparse")):
        got = section[as_dense]
        np.testing.assert_allclose(got["weight"], expected, rtol=1e-6, err_msg=f"rank {r}")
        assert got["grad_is_sparse"]  # handed back sparse, as SparseAdam & co. need
        assert got["names"] == ["weight"]


def test_reducescatter_with_adasum_raises_horovods_error_class(ranks):
    for section in _section(ranks, "sparse"):
        is_internal, message = section["rs_adasum"]
        assert is_internal and "op=Adasum is not supported by reducescatter" in message


def test_step_after_synchronize_warns_in_horovods_words(ranks):
    for section in _section(ranks, "sparse"):
        (message,) = section["step_warning"]
        assert "optimizer.step() called without optimizer.skip_synchronize()" in message


@pytest.mark.parametrize("n", [17, 1000])
@pytest.mark.parametrize("dtype", SCALED_DTYPES)
def test_scaling_and_average_as_in_horovod(ranks, n, dtype):
    """Horovod scales integers in float64 (truncating), float16 in float32, the rest as is."""
    import torch

    tdt = getattr(torch, dtype)
    math_dtype = {"float16": torch.float32, "int32": torch.float64, "int64": torch.float64}
    work = math_dtype.get(dtype, tdt)
    x = _scaling_base(n).to(tdt).to(work)
    factor = torch.tensor(FACTOR, dtype=torch.float64).to(work)
    pre = ((factor * x).to(tdt).to(work) * SIZE).to(tdt)  # each rank scales, then the sum
    post = ((SIZE * x) * factor).to(tdt)
    average = (x * 3 / 2).to(tdt)  # ranks hold x and 2x
    for r, section in enumerate(_section(ranks, "scaling")):
        for what, expected in (("pre", pre), ("post", post), ("avg", average)):
            np.testing.assert_array_equal(
                section[n, dtype, what], expected.numpy(), err_msg=f"rank {r} {what}"
            )


def test_grouped_allreduce_refuses_tensors_on_two_devices(ranks):
    for section in _section(ranks, "sparse"):
        is_internal, message = section["two_devices"]
        assert is_internal and "mixes CPU and GPU tensors" in message


def test_numpy_api_takes_the_dtypes_gloo_lacks(ranks):
    for values in _section(ranks, "values"):
        np.testing.assert_array_equal(values["numpy_int16"], np.array([1, 1, 2, 2], np.int16))
        assert values["numpy_int16"].dtype == np.int16
        # 600 bytes: past the inline room, so through Gloo; 120000 wraps around to 54464
        np.testing.assert_array_equal(values["numpy_uint16_sum"], np.full(300, 54464, np.uint16))
