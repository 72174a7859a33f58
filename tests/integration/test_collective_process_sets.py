"""Process sets and Adasum with 4 real rank processes on 127.0.0.1 (gloo and mpi).

One launch per backend runs ``_suite`` on every rank and returns what each rank saw; the tests
assert on it against numpy references written here (not the library's own Adasum code).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from spark_estimators.launch import run_local

SIZE = 4
EVEN, ODD, FIRST3 = [0, 2], [1, 3], [0, 1, 2]
LR = 0.1

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _vec(rank: int, n: int = 37, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(100 * salt + rank).standard_normal(n)


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def _adasum_ref(vectors: list[np.ndarray]) -> np.ndarray:
    """Horovod's pairwise tree over ranks: ((v0, v1), (v2, v3))."""
    while len(vectors) > 1:
        vectors = [_adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _suite() -> dict:
    import torch

    import spark_estimators.collective as core
    import spark_estimators.collective.torch as hvd

    even, odd = hvd.ProcessSet(EVEN), hvd.ProcessSet(ODD)
    hvd.init(process_sets=[even, odd])
    r = hvd.rank()
    mine = even if r in EVEN else odd
    other = odd if mine is even else even
    out: dict = {
        "repr": [repr(hvd.global_process_set), repr(even), repr(odd)],
        "set_rank_size": (mine.rank(), mine.size(), other.rank(), mine.included(),
                          other.included()),
    }  # fmt: skip
    value = float(r + 1)
    out["sum_small"] = hvd.allreduce(torch.tensor([value]), op=hvd.Sum, process_set=mine).item()
    big = torch.full((5000,), value)  # above the inline room: the backend's own allreduce
    out["avg_big"] = hvd.allreduce(big, process_set=mine).unique().tolist()
    out["numpy_sum"] = core.allreduce(np.array([value]), op=core.Sum, process_set=mine).tolist()
    out["grouped"] = [
        t.tolist()
        for t in hvd.grouped_allreduce(
            [torch.tensor([value]), torch.tensor([2 * value, 1.0])], op=hvd.Sum, process_set=mine
        )
    ]
    out["gather"] = hvd.allgather(torch.tensor([[value]]), process_set=mine).flatten().tolist()
    root = mine.ranks[-1]
    out["bcast"] = hvd.broadcast(torch.tensor([value]), root_rank=root, process_set=mine).item()
    out["bcast_bad_root"] = _error(
        lambda: hvd.broadcast(torch.tensor([value]), root_rank=other.ranks[0], process_set=mine)
    )
    out["a2a"] = hvd.alltoall(torch.tensor([value, value]), process_set=mine).tolist()
    out["objects"] = hvd.allgather_object(r, process_set=mine)
    hvd.barrier(process_set=mine)
    # async ops on the set and on the global set at once: both run, each among its ranks
    on_set = hvd.allreduce_async(torch.full((3000,), value), op=hvd.Sum, process_set=mine)
    on_all = hvd.allreduce_async(torch.full((3000,), value), op=hvd.Sum)
    out["concurrent"] = (hvd.synchronize(on_set)[0].item(), hvd.synchronize(on_all)[0].item())
    out["non_member"] = _error(lambda: hvd.allreduce(torch.ones(1), process_set=other))
    out["global_after"] = hvd.allreduce(torch.tensor([value]), op=hvd.Sum).item()

    # distributed optimizer and broadcast_parameters on a set
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    model.weight.data.fill_(float(r))
    hvd.broadcast_parameters(model.state_dict(), root_rank=mine.ranks[0], process_set=mine)
    out["w0"] = model.weight.detach().flatten().tolist()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), process_set=mine
    )
    x = torch.full((1, 3), value)
    model(x).sum().backward()
    opt.step()
    out["w1"] = model.weight.detach().flatten().tolist()
    from spark_estimators.collective.keras.optimizer import allreduce_numpy_buffers

    keras_buffers = [np.full(3, value)]  # what the Keras DistributedOptimizer(process_set=) runs
    allreduce_numpy_buffers(keras_buffers, hvd.Average, "keras", process_set=mine)
    out["keras_avg"] = keras_buffers[0].tolist()

    # Adasum: 4 ranks, a 2-rank set, grouped, a 3-rank set (refused)
    out["adasum4"] = hvd.allreduce(torch.from_numpy(_vec(r)), op=hvd.Adasum).numpy()
    out["adasum_np"] = core.allreduce(_vec(r).astype(np.float32), op=core.Adasum)
    out["adasum_set"] = hvd.allreduce(torch.from_numpy(_vec(r)), op=hvd.Adasum, process_set=mine)
    pair = [torch.from_numpy(_vec(r, 5, 1)), torch.from_numpy(_vec(r, 9, 2))]
    out["adasum_grouped"] = [t.numpy() for t in hvd.grouped_allreduce(pair, op=hvd.Adasum)]
    model2 = torch.nn.Linear(4, 1, bias=False)
    model2.weight.data.fill_(0.5)
    opt2 = hvd.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=LR), model2.named_parameters(), op=hvd.Adasum
    )
    model2(torch.from_numpy(_vec(r, 4, 3)).float().reshape(1, 4)).sum().backward()
    opt2.step()
    out["adasum_opt"] = model2.weight.detach().flatten().numpy()

    # dynamic sets: add, use, refuse non-members and non-power-of-two Adasum, remove
    first3 = hvd.add_process_set(FIRST3)
    out["first3_id"] = first3.process_set_id
    if first3.included():
        out["first3_sum"] = hvd.allreduce(torch.tensor([value]), op=hvd.Sum, process_set=first3)
        out["first3_adasum"] = _error(
            lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, process_set=first3)
        )
    else:
        out["first3_sum"] = _error(lambda: hvd.barrier(process_set=first3))
    out["duplicate"] = _error(lambda: hvd.add_process_set(EVEN))
    out["removed"] = hvd.remove_process_set(first3)
    out["removed_again"] = hvd.remove_process_set(first3)
    out["after_remove"] = _error(lambda: hvd.barrier(process_set=first3))
    out["remove_global"] = _error(lambda: hvd.remove_process_set(hvd.global_process_set))
    # ranks disagreeing on a new set: every rank gets the mismatch error, the group survives
    out["mismatch"] = _error(lambda: hvd.add_process_set([0, 1] if r < 2 else [2, 3]))
    out["still_works"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    if hvd.backend_name() == "mpi":
        from mpi4py import MPI

        sub = MPI.COMM_WORLD.Split(color=r % 2, key=r)
        split = hvd.add_process_set(hvd.ProcessSet(sub))
        out["split"] = (split.ranks, hvd.allreduce(torch.tensor([value]), op=hvd.Sum,
                                                   process_set=split).item())  # fmt: skip
    # Adasum needs every rank's data: with rank 3 joined, the others get a clear error (no hang)
    if r == 3:
        out["joined_adasum"] = hvd.join()
    else:
        out["joined_adasum"] = _error(lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum))
        hvd.join()
    hvd.shutdown()
    return out


BACKENDS = ["gloo"]
if importlib.util.find_spec("mpi4py") is not None:
    BACKENDS.append("mpi")


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request):
    return run_local(_suite, num_proc=SIZE, backend=request.param), request.param


def _set_of(rank: int) -> list[int]:
    return EVEN if rank in EVEN else ODD


def test_sets_print_like_horovod(ranks):
    out, _ = ranks
    assert out[0]["repr"][1] == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)"
    assert out[0]["repr"][2] == "ProcessSet(process_set_id=2, ranks=[1, 3], mpi_comm=None)"
    assert out[3]["repr"][0].startswith("ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3]")
    assert [o["set_rank_size"] for o in out] == [
        (0, 2, -1, True, False),
        (0, 2, -1, True, False),
        (1, 2, -1, True, False),
        (1, 2, -1, True, False),
    ]


def test_ops_run_among_members_only(ranks):
    out, _ = ranks
    for r, o in enumerate(out):
        members = _set_of(r)
        total = float(sum(m + 1 for m in members))
        assert o["sum_small"] == total
        assert o["numpy_sum"] == [total]
        assert o["avg_big"] == [total / 2]
        assert o["grouped"] == [[total], [2 * total, 2.0]]
        assert o["gather"] == [float(m + 1) for m in members]
        assert o["bcast"] == float(members[-1] + 1)  # root_rank is a global rank
        assert o["a2a"] == [float(m + 1) for m in members]
        assert o["objects"] == members
        assert o["global_after"] == 10.0
        assert o["concurrent"] == (total, 10.0)


def test_errors_name_the_set_and_the_rank(ranks):
    out, _ = ranks
    assert "rank 1, which is not a member" in out[1]["non_member"]
    assert "ranks [0, 2]" in out[1]["non_member"]
    assert "root_rank=1 is not a member" in out[0]["bcast_bad_root"]
    assert "already registered" in out[2]["duplicate"]
    assert "cannot be removed" in out[0]["remove_global"]
    assert all("mismatched collective op" in o["mismatch"] for o in out)
    assert [o["still_works"] for o in out] == [4.0] * SIZE


def test_optimizer_and_broadcast_parameters_on_a_set(ranks):
    out, _ = ranks
    for r, o in enumerate(out):
        members = _set_of(r)
        w0 = float(members[0])  # broadcast from the set's first rank
        assert o["w0"] == [w0] * 3
        mean_grad = np.mean([m + 1.0 for m in members])  # d(w.x)/dw = x = rank + 1
        np.testing.assert_allclose(o["w1"], [w0 - LR * mean_grad] * 3, rtol=1e-6)
        assert o["keras_avg"] == [mean_grad] * 3


def test_dynamic_set_add_use_remove(ranks):
    out, _ = ranks
    assert [o["first3_id"] for o in out] == [3] * SIZE
    assert [float(o["first3_sum"]) for o in out[:3]] == [6.0] * 3
    assert "not a member" in out[3]["first3_sum"]
    assert "power-of-two" in out[0]["first3_adasum"] and "got 3" in out[0]["first3_adasum"]
    assert [o["removed"] for o in out] == [True] * SIZE
    assert [o["removed_again"] for o in out] == [False] * SIZE
    assert all("was removed" in o["after_remove"] for o in out)


def test_adasum_matches_the_numpy_reference(ranks):
    out, _ = ranks
    expected = _adasum_ref([_vec(r) for r in range(SIZE)])
    for o in out:
        np.testing.assert_allclose(o["adasum4"], expected, rtol=1e-10)
        np.testing.assert_allclose(o["adasum_np"], expected.astype(np.float32), rtol=1e-5)
    # Adasum is neither the sum nor the average here (the vectors are not orthogonal/parallel)
    assert not np.allclose(expected, np.sum([_vec(r) for r in range(SIZE)], axis=0))
    for r, o in enumerate(out):
        pair = _adasum_ref([_vec(m) for m in _set_of(r)])
        np.testing.assert_allclose(o["adasum_set"].numpy(), pair, rtol=1e-10)
    grouped = [_adasum_ref([_vec(r, 5, 1) for r in range(SIZE)]),
               _adasum_ref([_vec(r, 9, 2) for r in range(SIZE)])]  # fmt: skip
    for o in out:
        for got, want in zip(o["adasum_grouped"], grouped):
            np.testing.assert_allclose(got, want, rtol=1e-10)


def test_adasum_with_a_joined_rank_fails_clearly(ranks):
    out, _ = ranks
    for o in out[:3]:
        assert "Adasum needs data from every rank" in o["joined_adasum"]
        assert "rank(s) [3] already called join()" in o["joined_adasum"]
    assert out[3]["joined_adasum"] in (0, 1, 2)  # the last rank to join


def test_adasum_optimizer_applies_the_adasum_of_the_deltas(ranks):
    out, _ = ranks
    deltas = [-LR * _vec(r, 4, 3).astype(np.float32).astype(np.float64) for r in range(SIZE)]
    expected = 0.5 + _adasum_ref(deltas)
    for o in out:
        np.testing.assert_allclose(o["adasum_opt"], expected, rtol=1e-5)


def test_mpi_communicator_sets(ranks):
    out, backend = ranks
    if backend != "mpi":
        pytest.skip("ProcessSet(comm) is for the mpi backend")
    for r, o in enumerate(out):
        members = _set_of(r)
        assert o["split"] == (members, float(sum(m + 1 for m in members)))
