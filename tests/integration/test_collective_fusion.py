"""Fusion of queued async allreduces (Horovod's tensor fusion), 2 real processes on 127.0.0.1.

The ranks count the engine's negotiation rounds and their backend's ``allreduce`` calls around
each case: N async allreduces fused into one round means one negotiation (and at most one
backend call) instead of N. A long cycle time (``HOROVOD_CYCLE_TIME``) makes the batches
deterministic: the engine then holds the queued ops until the caller waits for one
(``synchronize``), whatever the thread scheduling.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators import envvars as ev
from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

N = 1024  # float32 elements per tensor: 4 KiB
COUNT = 20
MANY = 100
# 10 minutes: only a waiter ends the wait. These tests count negotiation rounds and backend
# calls: the response cache (repeated batches without negotiation, its own tests in
# test_collective_response_cache.py) is off.
LONG_CYCLE = {ev.HOROVOD_CYCLE_TIME: "600000", ev.STEADY_ALLREDUCE: "0"}


def _counter():
    """The engine, and a dict counting its backend's allreduce calls (the real backend runs)."""
    from spark_estimators.collective.runtime import engine as eng

    engine = eng.current()
    assert engine is not None
    calls = {"allreduce": 0}
    backend_allreduce = engine.backend.allreduce

    def counted(buf, op):
        calls["allreduce"] += 1
        return backend_allreduce(buf, op)

    engine.backend.allreduce = counted  # type: ignore[method-assign]
    return engine, calls


def _fusion_suite() -> dict:
    import torch

    import spark_estimators.collective as core
    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    r = hvd.rank()
    engine, calls = _counter()
    out: dict = {"cycle": engine.cycle_time, "threshold": engine.fusion_threshold}
    pair = hvd.add_process_set([0, 1])  # its own engine: a round trip that spaces submissions

    def case(name, fn):
        rounds, backend = engine.rounds, calls["allreduce"]
        out[name] = fn()
        out[name + "_rounds"] = engine.rounds - rounds
        out[name + "_calls"] = calls["allreduce"] - backend

    def spaced_async():
        ts = [torch.full((N,), float(i + 1)) * (r + 1) for i in range(COUNT)]
        handles = []
        for t in ts:
            handles.append(hvd.allreduce_async_(t, op=hvd.Sum))
            hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair)
        for h in handles:
            hvd.synchronize(h)
        return [t[0].item() for t in ts] + [float(t.sum() / N) for t in ts]

    case("backend", spaced_async)  # 80 KiB: above the first round's inline room
    case("inline", spaced_async)  # the room has grown to 80 KiB: now inline

    def mixed():
        a = [torch.full((3,), 1.0 + r) for _ in range(4)]
        b = [torch.full((2,), 10.0 + r, dtype=torch.float64) for _ in range(4)]
        c = [torch.full((5,), 2.0 * (r + 1)) for _ in range(4)]
        hs = [hvd.allreduce_async_(t, op=hvd.Sum) for t in a]
        hs += [hvd.allreduce_async_(t, op=hvd.Sum) for t in b]
        hs += [hvd.allreduce_async_(t) for t in c]  # Average: not fused with the Sums
        hs.append(hvd.allreduce_async_(torch.full((3,), 5.0), name="named", op=hvd.Sum))
        for h in hs:
            hvd.synchronize(h)
        return [t.tolist() for t in a + b + c]

    case("mixed", mixed)

    def numpy_async():
        arrays = [np.full(7, float(r + i), dtype=np.float32) for i in range(6)]
        for h in [core.allreduce_async_(x, op=core.Sum) for x in arrays]:
            core.synchronize(h)
        return [x.tolist() for x in arrays]

    case("numpy", numpy_async)

    def out_of_place():
        ts = [torch.full((4,), float(r + i)) for i in range(5)]
        hs = [hvd.allreduce_async(t, op=hvd.Sum) for t in ts]
        return [hvd.synchronize(h).tolist() for h in hs] + [t.tolist() for t in ts]

    case("out_of_place", out_of_place)

    def reordered():
        """Rank 1 swaps the last two ops: the common first op runs, the rest fail clearly."""
        x = torch.ones(4) * (r + 1)
        a, b = torch.ones(6), torch.ones(8)
        order = [x, a, b] if r == 0 else [x, b, a]
        handles = [hvd.allreduce_async_(t, op=hvd.Sum) for t in order]
        results: list = []
        for h in handles:
            try:
                results.append(hvd.synchronize(h).tolist())
            except CollectiveError as exc:
                results.append(str(exc))
        results.append(hvd.allreduce(torch.ones(2) * (r + 1), op=hvd.Sum).tolist())
        return results

    case("reordered", reordered)

    def joined(size):
        """Rank 1 joins; rank 0's fused averages divide its data by 2 (zeros from rank 1)."""
        if r == 1:
            return hvd.join()
        ts = [torch.full((size,), 4.0 + i) for i in range(10)]
        hs = [hvd.allreduce_async_(t) for t in ts]
        values = [hvd.synchronize(h)[0].item() for h in hs]
        return values, hvd.join()

    def many(size):
        """More ops than the vector's first slot count (64): the slots grow for the next step."""
        ts = [torch.full((size,), float(i)) * (r + 1) for i in range(MANY)]
        for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in ts]:
            hvd.synchronize(h)
        return [float(t.sum()) / size for t in ts]

    for step in range(2):
        if step:  # more single blocking ops than the slots' window: they must not shrink it
            for _ in range(40):
                hvd.allreduce(torch.ones(1), op=hvd.Sum, name="metric")
        case(f"many_inline{step}", lambda: many(4))  # 1.6 KiB: inline
        case(f"many_backend{step}", lambda: many(1000))  # 400 KiB: above the inline limit
    case("joined_backend", lambda: joined(16 * N))  # 640 KiB: above the inline limit
    case("joined_inline", lambda: joined(8))  # 320 bytes: always inline
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def fused():
    return run_local(_fusion_suite, num_proc=2, env=LONG_CYCLE, backend="gloo")


def test_spaced_async_allreduces_are_fused_into_one_round(fused):
    sums = [3.0 * (i + 1) for i in range(COUNT)]  # ranks send (i+1)*1 and (i+1)*2
    for r, out in enumerate(fused):
        assert out["cycle"] == 600.0, r  # HOROVOD_CYCLE_TIME, milliseconds -> seconds
        assert out["backend"] == sums + sums, r
        assert out["backend_rounds"] == 1, r  # 20 ops, one negotiation
        assert out["backend_calls"] == 1, r  # ... and one backend reduction
        assert out["inline"] == sums + sums, r
        assert out["inline_rounds"] == 1, r
        assert out["inline_calls"] == 0, r  # the whole batch came with the negotiation


def test_only_compatible_ops_are_fused(fused):
    for r, out in enumerate(fused):
        a, b, c = out["mixed"][:4], out["mixed"][4:8], out["mixed"][8:]
        assert a == [[3.0] * 3] * 4, r
        assert b == [[21.0] * 2] * 4, r
        assert c == [[3.0] * 5] * 4, r  # average of 2 and 4
        # float32 Sum + named float32 Sum could fuse, but the float64 and the Average split them:
        # [a x4] [b x4] [c x4] [named]: 4 rounds, not 13 (and not 1).
        assert out["mixed_rounds"] == 4, r
        assert out["numpy"] == [[float(2 * i + 1)] * 7 for i in range(6)], r
        assert out["numpy_rounds"] == 1, r


def test_batches_longer_than_the_slots(fused):
    sums = [3.0 * i for i in range(MANY)]
    for r, out in enumerate(fused):
        for step in range(2):
            assert out[f"many_inline{step}"] == sums, (r, step)
            assert out[f"many_backend{step}"] == sums, (r, step)
        # First step: 64 slots, so 64 + 36; then the vectors list all 100.
        assert out["many_inline0_rounds"] == 2, r
        assert [out[f"many_{k}_rounds"] for k in ("backend0", "inline1", "backend1")] == [1] * 3
        assert out["many_inline0_calls"] == 0, r  # (the 40 metrics shrank the room for step 1)
        assert out["many_backend0_calls"] == out["many_backend1_calls"] == 1, r


def test_out_of_place_async_leaves_inputs(fused):
    for r, out in enumerate(fused):
        results, inputs = out["out_of_place"][:5], out["out_of_place"][5:]
        assert results == [[float(2 * i + 1)] * 4 for i in range(5)], r
        assert inputs == [[float(r + i)] * 4 for i in range(5)], r
        assert out["out_of_place_rounds"] == 1, r


def test_different_order_fails_on_every_rank_and_group_survives(fused):
    for r, out in enumerate(fused):
        first, second, third, after = out["reordered"]
        assert first == [3.0] * 4, r  # the prefix both ranks agree on still ran
        for message in (second, third):
            assert "mismatched collective op" in message, (r, message)
            assert "shape (6,)" in message and "shape (8,)" in message, (r, message)
        assert after == [3.0, 3.0], r


def test_joined_rank_mirrors_a_fused_batch(fused):
    for name in ("joined_backend", "joined_inline"):
        values, last = fused[0][name]
        assert values == [(4.0 + i) / 2 for i in range(10)], name
        assert last == 0 and fused[1][name] == 0, name  # rank 0 joined last
        assert fused[0][name + "_rounds"] < 10, name  # fused, not one round per op
    assert fused[0]["joined_backend_calls"] >= 1  # 640 KiB: the backend reduced it
    assert fused[1]["joined_backend_calls"] >= 1  # ... with rank 1's zeros
    assert fused[1]["joined_inline_calls"] == 0  # inline: nothing for the joined rank to send


def _rounds_for(count: int) -> dict:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    engine, calls = _counter()
    pair = hvd.add_process_set([0, 1])
    ts = [torch.full((N,), float(i)) * (r + 1) for i in range(count)]
    rounds = engine.rounds
    handles = []
    for t in ts:
        handles.append(hvd.allreduce_async_(t, op=hvd.Sum))
        hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair)
    for h in handles:
        hvd.synchronize(h)
    out = {
        "rounds": engine.rounds - rounds,
        "values": [t[0].item() for t in ts],
        "threshold": engine.fusion_threshold,
        "cycle": engine.cycle_time,
    }
    hvd.shutdown()
    return out


@pytest.mark.parametrize(
    ("env", "rounds", "threshold"),
    [
        ({ev.HOROVOD_FUSION_THRESHOLD: "0"}, 10, 0),  # no fusion: one round per op
        # ours wins over Horovod's: 3 tensors of 4 KiB per batch -> 4 rounds for 10 ops
        ({ev.FUSION_THRESHOLD: str(3 * 4 * N), ev.HOROVOD_FUSION_THRESHOLD: "0"}, 4, 3 * 4 * N),
    ],
    ids=["horovod-threshold-0", "ours-threshold-3-tensors"],
)
def test_fusion_threshold_env(env, rounds, threshold):
    outs = run_local(_rounds_for, 2, args=(10,), env={**LONG_CYCLE, **env}, backend="gloo")
    for r, out in enumerate(outs):
        assert out["threshold"] == threshold, r
        assert out["values"] == [3.0 * i for i in range(10)], r
        assert out["rounds"] == rounds, r


def test_cycle_time_zero_does_not_hold_ops():
    """Ours wins over Horovod's: cycle 0 negotiates each op as soon as the engine sees it.

    Between two submissions the caller blocks in a process-set round trip (releasing the GIL),
    so the engine thread has taken the first op alone long before the last is submitted: more
    than one round, where the long cycle above gives exactly one.
    """
    env = {**LONG_CYCLE, ev.CYCLE_TIME: "0"}
    outs = run_local(_rounds_for, 2, args=(10,), env=env, backend="gloo")
    for r, out in enumerate(outs):
        assert out["cycle"] == 0.0, r
        assert out["values"] == [3.0 * i for i in range(10)], r
        assert out["rounds"] > 1, r
