"""Every collective op with 2 real processes on 127.0.0.1, checked against numpy references.

One launch per backend runs the whole suite (``_op_suite``) and returns what each rank saw;
the tests below assert on it. Add "mpi" to BACKENDS once its backend exists.

Allreduces run twice: on small tensors (their data travels inside the negotiation message) and
on tensors above ``INLINE_BYTES`` (a separate backend reduction); VARIANTS names the two. The
suite runs with ``SPARK_ESTIMATORS_INLINE_LIMIT=0`` so the large ones keep taking the backend
path (the growing inline room is tested in test_collective_inline.py).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from spark_estimators.launch import run_local

SIZE = 2
SEED = 1234
BACKENDS = ["gloo"]
VARIANTS = ["", "_big"]  # key suffixes: small (inline) and large (backend) allreduces

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _rank_data(rank: int) -> dict:
    """Inputs of one rank; the tests rebuild every rank's inputs for the references."""
    rng = np.random.default_rng(SEED + rank)
    return {
        "f32": rng.standard_normal((5, 3)).astype(np.float32),
        "f64": rng.standard_normal(7),
        "i32": rng.integers(-5, 6, size=(4, 2)).astype(np.int32),
        "pos": rng.uniform(0.5, 1.5, size=6).astype(np.float32),
        "i64": rng.integers(0, 100, size=4).astype(np.int64),
        "f32_big": rng.standard_normal((40, 10)).astype(np.float32),
        "f64_big": rng.standard_normal(100),
        "i32_big": rng.integers(-5, 6, size=(50, 4)).astype(np.int32),
        "pos_big": rng.uniform(0.5, 1.5, size=200).astype(np.float32),
        "i64_big": rng.integers(0, 100, size=100).astype(np.int64),
        "gather": rng.standard_normal((rank + 2, 3)).astype(np.float32),
        "gather_maybe_empty": rng.standard_normal((3 * rank, 2)).astype(np.float32),
        "a2a": rng.standard_normal((5, 2)).astype(np.float32),
        "a2a_splits": [2, 3] if rank == 0 else [4, 1],
        "a2a_even": rng.standard_normal((4, 3)).astype(np.float32),
        "rs_even": rng.standard_normal((4, 3)).astype(np.float32),
        "rs_uneven": rng.standard_normal((5, 2)).astype(np.float32),
        "fp16src": rng.standard_normal(1000).astype(np.float32),
    }


def _op_suite() -> dict:
    import torch

    import spark_estimators.collective as core
    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError, ConfigurationError

    hvd.init()
    r = hvd.rank()
    d = _rank_data(r)

    def t(name):
        return torch.from_numpy(d[name].copy())

    out: dict = {
        "topology": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                     hvd.cross_rank(), hvd.cross_size()),
        "backend": hvd.backend_name(),
        "mpi_threads_supported": hvd.mpi_threads_supported(),
        "is_initialized": hvd.is_initialized(),
    }  # fmt: skip
    # allreduce: ops, scaling, compression, in place, async; small and large tensors
    for v in VARIANTS:
        out["avg_f32" + v] = hvd.allreduce(t("f32" + v)).numpy()
        out["sum_f64" + v] = hvd.allreduce(t("f64" + v), op=hvd.Sum).numpy()
        out["average_false" + v] = hvd.allreduce(t("f64" + v), average=False).numpy()
        out["min_i32" + v] = hvd.allreduce(t("i32" + v), op=hvd.Min).numpy()
        out["max_i32" + v] = hvd.allreduce(t("i32" + v), op=hvd.Max).numpy()
        out["sum_i32" + v] = hvd.allreduce(t("i32" + v), op=hvd.Sum).numpy()
        out["product" + v] = hvd.allreduce(t("pos" + v), op=hvd.Product).numpy()
        out["scaled_sum" + v] = hvd.allreduce(
            t("f32" + v), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0
        ).numpy()
        out["scaled_avg" + v] = hvd.allreduce(
            t("f32" + v), prescale_factor=2.0, postscale_factor=0.25
        ).numpy()
        grouped = hvd.grouped_allreduce([t("f32" + v), t("f64" + v), t("i64" + v)], op=hvd.Sum)
        out["grouped" + v] = [g.numpy() for g in grouped]
        tensors = [t("f32" + v), t("pos" + v)]
        hvd.grouped_allreduce_(tensors)
        out["grouped_inplace_avg" + v] = [g.numpy() for g in tensors]
    fp16 = hvd.allreduce(t("fp16src"), op=hvd.Sum, compression=hvd.Compression.fp16)
    out["fp16"], out["fp16_dtype"] = fp16.numpy(), str(fp16.dtype)
    src = t("f32")
    out["input_untouched"] = np.array_equal(src.numpy(), d["f32"])
    x = t("f32")
    out["inplace_is_same"] = hvd.allreduce_(x, op=hvd.Sum) is x
    out["inplace"] = x.numpy()
    y = t("f64")
    handle = hvd.allreduce_async_(y, op=hvd.Max, name="async.max")
    out["async_max"] = hvd.synchronize(handle).numpy()
    out["poll_after_sync"] = hvd.poll(handle)
    handles = [hvd.allreduce_async(t("f64") * k, op=hvd.Sum, name=f"k{k}") for k in range(3)]
    out["async_many"] = [hvd.synchronize(h).numpy() for h in handles]
    # allgather, broadcast, alltoall, reducescatter
    out["allgather"] = hvd.allgather(t("gather")).numpy()
    out["allgather_empty"] = hvd.allgather(t("gather_maybe_empty")).numpy()
    out["allgather_i64"] = hvd.allgather(t("i64")).numpy()
    out["broadcast"] = hvd.broadcast(t("f32"), root_rank=1).numpy()
    b = t("f64")
    hvd.broadcast_(b, root_rank=0)
    out["broadcast_inplace"] = b.numpy()
    received, splits = hvd.alltoall(t("a2a"), splits=d["a2a_splits"])
    out["alltoall"], out["alltoall_splits"] = received.numpy(), splits.numpy()
    out["alltoall_even"] = hvd.alltoall(t("a2a_even")).numpy()
    out["rs_even_sum"] = hvd.reducescatter(t("rs_even"), op=hvd.Sum).numpy()
    out["rs_uneven_avg"] = hvd.reducescatter(t("rs_uneven")).numpy()
    out["rs_uneven_max"] = hvd.reducescatter(t("rs_uneven"), op=hvd.Max).numpy()
    hvd.barrier()
    out["allgather_object"] = hvd.allgather_object({"rank": r, "items": list(range(r))})
    out["broadcast_object"] = hvd.broadcast_object(("from", r), root_rank=1)
    # the numpy core API (what the Keras and MPI work build on)
    out["np_sum"] = core.allreduce(d["f32"], op=core.Sum)
    buf = d["f64"].copy()
    core.allreduce_(buf)
    out["np_inplace_avg"] = buf
    out["np_grouped"] = core.grouped_allreduce([d["f32"], d["i64"]], op=core.Sum)
    out["np_allgather"] = core.allgather(d["gather"])
    out["np_broadcast"] = core.broadcast(d["f32"], root_rank=1)
    out["np_alltoall"] = core.alltoall(d["a2a"], splits=d["a2a_splits"])
    out["np_reducescatter"] = core.reducescatter(d["rs_uneven"], op=core.Sum)
    out["np_objects"] = (core.allgather_object(r * 10), core.broadcast_object({"r": r}, 0))
    # mismatches raise on every rank, and the group stays usable
    errors = {}
    attempts = {
        "shape": lambda: hvd.allreduce(torch.ones(2 + r), name="grad.w"),
        "dtype": lambda: hvd.allreduce(
            torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64), name="grad.b"
        ),
        "kind": lambda: (hvd.allreduce(torch.ones(3), name="mixed") if r == 0
                         else hvd.broadcast(torch.ones(3), 0, name="mixed")),
        "allgather_dims": lambda: hvd.allgather(torch.ones(2, 3 + r), name="feats"),
        "op": lambda: hvd.allreduce(torch.ones(3), name="ops", op=hvd.Sum if r else hvd.Max),
    }  # fmt: skip
    for key, attempt in attempts.items():
        try:
            attempt()
            errors[key] = None
        except CollectiveError as exc:
            errors[key] = str(exc)
    out["errors"] = errors
    out["after_errors"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy()
    out["avg_int"] = hvd.allreduce(t("i32")).numpy()  # Horovod: in float64, truncated
    out["avg_int_big"] = hvd.allreduce(t("i32_big"), postscale_factor=0.5).numpy()
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.bool))
        out["avg_bool_error"] = None
    except ConfigurationError as exc:
        out["avg_bool_error"] = str(exc)
    # autograd through allreduce, allgather, broadcast
    xg = torch.tensor(d["f32"], requires_grad=True)
    (hvd.allreduce(xg, op=hvd.Sum) * (r + 1)).sum().backward()
    out["grad_allreduce"] = xg.grad.numpy()
    ag = torch.tensor(d["gather"], requires_grad=True)
    gathered = hvd.allgather(ag)
    coeff = torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1) + 1
    (gathered * coeff).sum().backward()
    out["grad_allgather"] = ag.grad.numpy()
    bg = torch.tensor(d["f32"], requires_grad=True)
    hvd.broadcast(bg, root_rank=0).sum().backward()
    out["grad_broadcast"] = bg.grad.numpy()
    # model and optimizer state
    torch.manual_seed(100 + r)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["params"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    model(torch.ones(4, 3) * (r + 1)).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    out["opt_lr"] = state["param_groups"][0]["lr"]
    out["opt_exp_avg"] = state["state"][0]["exp_avg"].numpy().copy()
    # join: rank 1 runs out of data first; rank 0's allreduces see zeros from it
    if r == 1:
        out["join_last"] = hvd.join()
    else:
        out["join_sum"] = hvd.allreduce(torch.ones(3), op=hvd.Sum).numpy()
        out["join_avg"] = hvd.allreduce(torch.full((2,), 4.0)).numpy()
        out["join_avg_big"] = hvd.allreduce(torch.full((1000,), 4.0)).numpy()
        out["join_grouped_big"] = [
            g.numpy() for g in hvd.grouped_allreduce([torch.ones(300), torch.ones(300)], op=hvd.Sum)
        ]
        hvd.barrier()
        out["join_last"] = hvd.join()
    out["after_join"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy()
    hvd.shutdown()
    out["is_initialized_after_shutdown"] = hvd.is_initialized()
    try:
        hvd.allreduce(torch.ones(1))
        out["after_shutdown_error"] = None
    except CollectiveError as exc:
        out["after_shutdown_error"] = str(exc)
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def suite(request):
    backend = request.param
    if (
        backend == "mpi"
        and importlib.util.find_spec("spark_estimators.collective.backends.mpi") is None
    ):
        pytest.skip("the mpi backend is not implemented yet")
    return run_local(
        _op_suite, num_proc=SIZE, backend=backend, env={"SPARK_ESTIMATORS_INLINE_LIMIT": "0"}
    )


@pytest.fixture(scope="module")
def data():
    return [_rank_data(r) for r in range(SIZE)]


def _both(suite, key):
    return [suite[r][key] for r in range(SIZE)]


def _all_equal(suite, key, expected, **tol):
    for r, got in enumerate(_both(suite, key)):
        np.testing.assert_allclose(got, expected, err_msg=f"{key} on rank {r}", **tol)


def test_topology_and_backend(suite):
    assert [s["topology"] for s in suite] == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)]
    assert all(s["backend"] in BACKENDS and s["is_initialized"] for s in suite)
    assert [s["mpi_threads_supported"] for s in suite] == [False, False]


def test_small_and_large_variants_take_both_paths():
    from spark_estimators.collective.runtime.negotiation import INLINE_BYTES

    small, big = _rank_data(0), _rank_data(0)
    for key in ("f32", "f64", "i32", "pos", "i64"):
        assert small[key].nbytes <= INLINE_BYTES < big[key + "_big"].nbytes


@pytest.mark.parametrize("v", VARIANTS)
def test_allreduce_ops_match_numpy(suite, data, v):
    d0, d1 = data
    _all_equal(suite, "avg_f32" + v, (d0["f32" + v] + d1["f32" + v]) / 2, rtol=1e-6)
    _all_equal(suite, "sum_f64" + v, d0["f64" + v] + d1["f64" + v], rtol=1e-12)
    _all_equal(suite, "average_false" + v, d0["f64" + v] + d1["f64" + v], rtol=1e-12)
    _all_equal(suite, "min_i32" + v, np.minimum(d0["i32" + v], d1["i32" + v]), rtol=0)
    _all_equal(suite, "max_i32" + v, np.maximum(d0["i32" + v], d1["i32" + v]), rtol=0)
    _all_equal(suite, "sum_i32" + v, d0["i32" + v] + d1["i32" + v], rtol=0)
    _all_equal(suite, "product" + v, d0["pos" + v] * d1["pos" + v], rtol=1e-6)
    assert suite[0]["sum_i32" + v].dtype == np.int32
    np.testing.assert_array_equal(suite[0]["avg_f32" + v], suite[1]["avg_f32" + v])


@pytest.mark.parametrize("v", VARIANTS)
def test_prescale_and_postscale(suite, data, v):
    a, b = data[0]["f32" + v], data[1]["f32" + v]
    _all_equal(suite, "scaled_sum" + v, 3.0 * (0.5 * a + 0.5 * b), rtol=1e-6)
    _all_equal(suite, "scaled_avg" + v, 0.25 * (2 * a + 2 * b) / 2, rtol=1e-6)


def test_fp16_compression_within_tolerance(suite, data):
    exact = data[0]["fp16src"] + data[1]["fp16src"]
    _all_equal(suite, "fp16", exact, rtol=2e-3, atol=2e-3)
    assert _both(suite, "fp16_dtype") == ["torch.float32"] * 2
    # the compressed result is not the exact one: fp16 really was on the wire
    assert not np.array_equal(suite[0]["fp16"], exact.astype(np.float32))


def test_inplace_and_async(suite, data):
    d0, d1 = data
    assert _both(suite, "input_untouched") == [True, True]
    assert _both(suite, "inplace_is_same") == [True, True]
    _all_equal(suite, "inplace", d0["f32"] + d1["f32"], rtol=1e-6)
    _all_equal(suite, "async_max", np.maximum(d0["f64"], d1["f64"]), rtol=0)
    assert _both(suite, "poll_after_sync") == [True, True]
    for k in range(3):
        for r in range(SIZE):
            np.testing.assert_allclose(suite[r]["async_many"][k], k * (d0["f64"] + d1["f64"]))


@pytest.mark.parametrize("v", VARIANTS)
def test_grouped_allreduce(suite, data, v):
    d0, d1 = data
    for r in range(SIZE):
        f32, f64, i64 = suite[r]["grouped" + v]
        np.testing.assert_allclose(f32, d0["f32" + v] + d1["f32" + v], rtol=1e-6)
        np.testing.assert_allclose(f64, d0["f64" + v] + d1["f64" + v], rtol=1e-12)
        np.testing.assert_array_equal(i64, d0["i64" + v] + d1["i64" + v])
        assert i64.dtype == np.int64
        a, b = suite[r]["grouped_inplace_avg" + v]
        np.testing.assert_allclose(a, (d0["f32" + v] + d1["f32" + v]) / 2, rtol=1e-6)
        np.testing.assert_allclose(b, (d0["pos" + v] + d1["pos" + v]) / 2, rtol=1e-6)


def test_allgather_uneven_first_dimension(suite, data):
    d0, d1 = data
    _all_equal(suite, "allgather", np.concatenate([d0["gather"], d1["gather"]]), rtol=0)
    assert suite[0]["allgather"].shape == (5, 3)
    expected = np.concatenate([d0["gather_maybe_empty"], d1["gather_maybe_empty"]])
    assert expected.shape == (3, 2)  # rank 0 contributes no rows
    _all_equal(suite, "allgather_empty", expected, rtol=0)
    _all_equal(suite, "allgather_i64", np.concatenate([d0["i64"], d1["i64"]]), rtol=0)


def test_broadcast(suite, data):
    _all_equal(suite, "broadcast", data[1]["f32"], rtol=0)
    _all_equal(suite, "broadcast_inplace", data[0]["f64"], rtol=0)


def test_alltoall_with_and_without_splits(suite, data):
    d0, d1 = data
    # rank 0 sends rows [0:2] to 0 and [2:5] to 1; rank 1 sends [0:4] to 0 and [4:5] to 1
    expected = [
        np.concatenate([d0["a2a"][:2], d1["a2a"][:4]]),
        np.concatenate([d0["a2a"][2:], d1["a2a"][4:]]),
    ]
    for r in range(SIZE):
        np.testing.assert_array_equal(suite[r]["alltoall"], expected[r])
    assert suite[0]["alltoall_splits"].tolist() == [2, 4]
    assert suite[1]["alltoall_splits"].tolist() == [3, 1]
    for r in range(SIZE):
        even = np.concatenate(
            [d0["a2a_even"][2 * r : 2 * r + 2], d1["a2a_even"][2 * r : 2 * r + 2]]
        )
        np.testing.assert_array_equal(suite[r]["alltoall_even"], even)


def test_reducescatter(suite, data):
    d0, d1 = data
    total = d0["rs_even"] + d1["rs_even"]
    np.testing.assert_allclose(suite[0]["rs_even_sum"], total[:2], rtol=1e-6)
    np.testing.assert_allclose(suite[1]["rs_even_sum"], total[2:], rtol=1e-6)
    avg = (d0["rs_uneven"] + d1["rs_uneven"]) / 2  # 5 rows: rank 0 gets 3, rank 1 gets 2
    np.testing.assert_allclose(suite[0]["rs_uneven_avg"], avg[:3], rtol=1e-6)
    np.testing.assert_allclose(suite[1]["rs_uneven_avg"], avg[3:], rtol=1e-6)
    mx = np.maximum(d0["rs_uneven"], d1["rs_uneven"])
    np.testing.assert_array_equal(suite[0]["rs_uneven_max"], mx[:3])
    np.testing.assert_array_equal(suite[1]["rs_uneven_max"], mx[3:])


def test_objects(suite):
    expected = [{"rank": 0, "items": []}, {"rank": 1, "items": [0]}]
    assert _both(suite, "allgather_object") == [expected, expected]
    assert _both(suite, "broadcast_object") == [("from", 1), ("from", 1)]


def test_numpy_core_api(suite, data):
    d0, d1 = data
    _all_equal(suite, "np_sum", d0["f32"] + d1["f32"], rtol=1e-6)
    _all_equal(suite, "np_inplace_avg", (d0["f64"] + d1["f64"]) / 2, rtol=1e-12)
    _all_equal(suite, "np_allgather", np.concatenate([d0["gather"], d1["gather"]]), rtol=0)
    _all_equal(suite, "np_broadcast", d1["f32"], rtol=0)
    for r in range(SIZE):
        f32, i64 = suite[r]["np_grouped"]
        np.testing.assert_allclose(f32, d0["f32"] + d1["f32"], rtol=1e-6)
        np.testing.assert_array_equal(i64, d0["i64"] + d1["i64"])
        received, splits = suite[r]["np_alltoall"]
        assert splits.tolist() == ([2, 4] if r == 0 else [3, 1])
        assert received.shape == ((6, 2) if r == 0 else (4, 2))
        assert suite[r]["np_objects"] == ([0, 10], {"r": 0})
    total = d0["rs_uneven"] + d1["rs_uneven"]
    np.testing.assert_allclose(suite[0]["np_reducescatter"], total[:3], rtol=1e-6)
    np.testing.assert_allclose(suite[1]["np_reducescatter"], total[3:], rtol=1e-6)


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("shape", ["'grad.w'", "shape (2,)", "shape (3,)"]),
        ("dtype", ["'grad.b'", "float32", "float64"]),
        ("kind", ["'mixed'", "allreduce", "broadcast"]),
        ("allgather_dims", ["'feats'", "shape (2, 3)", "shape (2, 4)"]),
        ("op", ["'ops'", "op=MAX", "op=SUM"]),
    ],
)
def test_mismatch_raises_on_every_rank_naming_the_tensor(suite, key, names):
    for r in range(SIZE):
        message = suite[r]["errors"][key]
        assert message is not None, f"rank {r} did not raise for a {key} mismatch"
        for fragment in names + ["rank 0", "rank 1"]:
            assert fragment in message, (fragment, message)
    _all_equal(suite, "after_errors", np.full(2, 2.0), rtol=0)


def test_integers_average_and_scale_as_in_horovod(suite, data):
    # Horovod scales integer tensors in float64 and truncates toward zero (its test_torch.py
    # averages and pre/postscales IntTensor/LongTensor); bool has no average.
    d0, d1 = data
    expected = np.trunc((d0["i32"] + d1["i32"]) / 2).astype(np.int32)
    big = np.trunc((d0["i32_big"] + d1["i32_big"]) * 0.5 * 0.5).astype(np.int32)
    for r in range(SIZE):
        np.testing.assert_array_equal(suite[r]["avg_int"], expected)
        assert suite[r]["avg_int"].dtype == np.int32
        np.testing.assert_array_equal(suite[r]["avg_int_big"], big)
        assert "op=Average" in suite[r]["avg_bool_error"] and "bool" in suite[r]["avg_bool_error"]


def test_autograd(suite, data):
    # d/dx sum((allreduce_sum(x)) * (rank + 1)) on every rank = sum over ranks of (rank + 1)
    _all_equal(suite, "grad_allreduce", np.full((5, 3), 3.0), rtol=0)
    # allgather and broadcast: Horovod's gradients, the *average* over ranks of the incoming
    # gradients (this rank's rows of it; zeros off the root), as horovod's test_torch.py expects
    coeff = np.arange(5, dtype=np.float32)[:, None] + 1
    np.testing.assert_allclose(suite[0]["grad_allgather"], np.broadcast_to(coeff[:2], (2, 3)))
    np.testing.assert_allclose(suite[1]["grad_allgather"], np.broadcast_to(coeff[2:], (3, 3)))
    np.testing.assert_array_equal(suite[0]["grad_broadcast"], np.full((5, 3), 1.0))
    np.testing.assert_array_equal(suite[1]["grad_broadcast"], np.zeros((5, 3)))


def test_broadcast_parameters_and_optimizer_state(suite):
    import torch

    torch.manual_seed(100)  # rank 0's initialisation
    reference = torch.nn.Linear(3, 2).state_dict()
    for r in range(SIZE):
        for k, v in reference.items():
            np.testing.assert_array_equal(suite[r]["params"][k], v.numpy())
    assert _both(suite, "opt_lr") == [0.1, 0.1]
    np.testing.assert_array_equal(suite[0]["opt_exp_avg"], suite[1]["opt_exp_avg"])


def test_join(suite):
    assert _both(suite, "join_last") == [0, 0]
    np.testing.assert_array_equal(suite[0]["join_sum"], np.ones(3))  # rank 1 adds zeros
    np.testing.assert_array_equal(suite[0]["join_avg"], np.full(2, 2.0))  # divided by size()
    np.testing.assert_array_equal(suite[0]["join_avg_big"], np.full(1000, 2.0))
    for g in suite[0]["join_grouped_big"]:
        np.testing.assert_array_equal(g, np.ones(300))
    _all_equal(suite, "after_join", np.full(2, 2.0), rtol=0)


def test_shutdown_then_ops_explain_init(suite):
    assert _both(suite, "is_initialized_after_shutdown") == [False, False]
    for r in range(SIZE):
        assert "before init()" in suite[r]["after_shutdown_error"]
