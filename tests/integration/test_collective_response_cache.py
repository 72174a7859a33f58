"""The engine's response cache (collective/runtime/cache.py) with real rank processes.

A batch of allreduces negotiated once runs again as one local-mesh round, without the
negotiation. These tests check that it is taken (its counter), that it gives bit for bit the
negotiated path's results (the same job with ``SPARK_ESTIMATORS_STEADY_ALLREDUCE=0``), and that
ranks out of step (another batch, another shape, ``join()``, a dead peer) get the negotiated
path's behaviour or a clear error, never a hang or mixed tensors. A long cycle time makes the
batches deterministic: only ``synchronize`` ends the engine's wait.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from spark_estimators import envvars as ev
from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

LONG_CYCLE = {ev.HOROVOD_CYCLE_TIME: "600000"}
OFF = {**LONG_CYCLE, ev.STEADY_ALLREDUCE: "0"}
ROUNDS = 3


def _counters() -> tuple[int, int] | None:
    from spark_estimators.collective.runtime import engine as eng

    engine = eng.current()
    assert engine is not None
    cache = engine.cache
    return None if cache is None else (cache.taken, cache.voided)


def _batches() -> dict[str, Any]:
    """Each case's results (raw bytes) over ROUNDS rounds of fresh data, and the cache's use."""
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    g = torch.Generator().manual_seed(10 + hvd.rank())

    sent: list[bytes] = []  # each round's inputs, before they are reduced in place

    def data(dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        if dtype.is_floating_point:
            ts = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        else:
            ts = [torch.randint(-1000, 1000, s, generator=g, dtype=dtype) for s in shapes]
        sent.append(b"".join(t.numpy().tobytes() for t in ts))
        return ts

    def each(dtype: torch.dtype, shapes: list[tuple[int, ...]], **kw: Any) -> Any:
        def step() -> list[torch.Tensor]:
            ts = data(dtype, shapes)
            for h in [hvd.allreduce_async_(t, **kw) for t in ts]:
                hvd.synchronize(h)
            return ts

        return step

    def grouped(dtype: torch.dtype, shapes: list[tuple[int, ...]], **kw: Any) -> Any:
        return lambda: hvd.grouped_allreduce_(data(dtype, shapes), **kw)

    cases = {
        # 30 x 4 KiB: above the inline room when first negotiated (the backend's ring then)
        "sum_f32": each(torch.float32, [(1024,)] * 30, op=hvd.Sum),
        "avg_scaled_f16": each(
            torch.float16, [(300,), (7, 5)] * 4, prescale_factor=0.5, postscale_factor=3.0
        ),  # fmt: skip
        "grouped_avg_f64": grouped(torch.float64, [(3, 4), (700,), (1,)]),
        "sum_i32": each(torch.int32, [(64,)] * 10, op=hvd.Sum),
        "min_f32": each(torch.float32, [(2048,), (9,)], op=hvd.Min),
        "avg_i64": each(torch.int64, [(5,)] * 3),
    }
    out: dict[str, Any] = {}
    for name, step in cases.items():
        before = _counters()
        out[name] = [b"".join(t.numpy().tobytes() for t in step()) for _ in range(ROUNDS)]
        out[name + "_sent"], sent[:] = list(sent), []
        after = _counters()
        out[name + "_counts"] = None if after is None else [a - b for a, b in zip(after, before)]
    hvd.shutdown()
    return out


@pytest.mark.parametrize(
    "ranks", [2, pytest.param(3, marks=pytest.mark.slow, id="3-ranks-tag-rounds")]
)
def test_cached_rounds_are_taken_and_equal_the_negotiated_path_bit_for_bit(ranks: int) -> None:
    cached = run_local(_batches, num_proc=ranks, env=LONG_CYCLE)
    negotiated = run_local(_batches, num_proc=ranks, env=OFF)
    for name in ("sum_f32", "avg_scaled_f16", "grouped_avg_f64", "sum_i32", "min_f32", "avg_i64"):
        for rank in range(ranks):
            # every round after the first comes from the cache, none fell back
            assert cached[rank][name + "_counts"] == [ROUNDS - 1, 0], (name, rank)
            assert negotiated[rank][name + "_counts"] is None, (name, rank)
            assert cached[rank][name] == negotiated[rank][name], (name, rank)  # same bits
            assert cached[rank][name] == cached[0][name], (name, rank)  # on every rank
    # And the bits themselves, where they are exact in any order: what every rank sent, reduced
    # (a float sum of 2 ranks is; of 3, the tag round's ring may add in another order).
    exact = [("sum_i32", np.int32, np.add), ("min_f32", np.float32, np.minimum)]
    if ranks == 2:
        exact.append(("sum_f32", np.float32, np.add))
    for name, dtype, reduce in exact:
        for round_ in range(ROUNDS):
            sent = [np.frombuffer(cached[r][name + "_sent"][round_], dtype) for r in range(ranks)]
            expected = functools.reduce(reduce, sent)
            got = np.frombuffer(cached[0][name][round_], dtype)
            assert got.tobytes() == expected.tobytes(), (name, round_)


def _out_of_step() -> dict[str, Any]:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    rank, out = hvd.rank(), {}

    def run(shapes: list[int], submit_last_late: bool = False) -> list[list[float]]:
        ts = [torch.full((n,), float(rank + 1 + i)) for i, n in enumerate(shapes)]
        handles = [
            hvd.allreduce_async_(t, op=hvd.Sum) for t in ts[: -1 if submit_last_late else None]
        ]
        hvd.synchronize(handles[0])  # runs the batch queued so far
        if submit_last_late:
            handles.append(hvd.allreduce_async_(ts[-1], op=hvd.Sum))
        for h in handles:
            hvd.synchronize(h)
        return [t.tolist() for t in ts]

    run([4, 5, 6])
    run([4, 5, 6])
    out["armed"] = _counters()
    # Rank 1 runs the first two as a batch of their own: rank 0's cached round is void, both
    # negotiate, the prefix they share runs, then the last op alone.
    out["diverged"] = run([4, 5, 6], submit_last_late=rank == 1)
    out["after_diverged"] = _counters()
    run([4, 5])
    run([4, 5])
    # Another shape on rank 1: the usual mismatch error on every rank, the group survives.
    try:
        run([4, 5] if rank == 0 else [4, 7])
        out["error"] = "no error"
    except CollectiveError as exc:
        out["error"] = str(exc)
    out["after_error"] = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item()
    out["before_join"] = _counters()
    run([4, 5])
    # join(): rank 1 stops; rank 0's cached round is void, then it gets its own data (Sum).
    if rank == 1:
        out["join"] = hvd.join()
    else:
        out["alone"] = run([4, 5])
        out["join"] = hvd.join()
    out["end"] = _counters()
    hvd.shutdown()
    return out


def test_ranks_out_of_step_fall_back_to_negotiation_errors_and_join() -> None:
    outs = run_local(_out_of_step, num_proc=2, env=LONG_CYCLE)
    for rank, out in enumerate(outs):
        assert out["armed"] == (1, 0), rank
        # 1+2, 2+3, 3+4 whatever the batches: never another rank's other tensor
        assert out["diverged"] == [[3.0] * 4, [5.0] * 5, [7.0] * 6], rank
        assert "mismatched collective op" in out["error"], out["error"]
        assert "shape (5,)" in out["error"] and "shape (7,)" in out["error"], out["error"]
        assert out["after_error"] == 3.0
        assert out["join"] == 0  # rank 0 joined last
    # rank 0 tried its cached batch of 3 and fell back; rank 1 had no such batch to try
    assert outs[0]["after_diverged"] == (1, 1)
    assert outs[1]["after_diverged"] == (1, 0)
    assert outs[0]["alone"] == [[1.0] * 4, [2.0] * 5]  # rank 1 contributed zeros
    # the mismatch voided rank 0's cached try; the error left no back-off (nothing was learnt),
    # so the next [4, 5] came from the cache on both ranks; rank 0's try beside join() was void
    assert outs[0]["before_join"][1] == 2
    assert [out["end"][0] - out["before_join"][0] for out in outs] == [1, 1]
    assert outs[0]["end"][1] == 3 and outs[1]["end"][1] == 0


def _peer_dies() -> dict[str, Any]:
    import os
    import time

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    ts = [torch.ones(1024) for _ in range(10)]

    def step() -> None:
        for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in ts]:
            hvd.synchronize(h)

    step()
    step()
    if hvd.rank() == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        step()
        return {"error": "no error"}
    except CollectiveError as exc:
        seconds = time.monotonic() - start
        try:
            step()
            later = "no error"
        except CollectiveError as again:
            later = str(again)
        return {"error": str(exc), "seconds": seconds, "counts": _counters(), "later": later}


def test_a_dead_peer_fails_the_cached_round_at_once_with_a_clear_error() -> None:
    outs = run_local(
        _peer_dies,
        num_proc=2,
        env={**LONG_CYCLE, "SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": "60"},
        fail_fast=False,
        return_failures=True,
    )
    out = outs[0]
    assert isinstance(out, dict), out
    assert "failed on rank 0" in out["error"], out["error"]
    assert "closed its local mesh connection" in out["error"], out["error"]
    assert out["seconds"] < 30  # the socket's end, not the 60 s collective timeout
    assert out["counts"][0] == 1  # the second step came from the cache
    assert "the collective group is broken" in out["later"], out["later"]


def _back_in_step() -> dict[str, Any]:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    rank, out = hvd.rank(), {}

    def run(sizes: list[int]) -> None:
        handles = [hvd.allreduce_async_(torch.ones(n) * (rank + 1), op=hvd.Sum) for n in sizes]
        for h in handles:
            hvd.synchronize(h)

    for _ in range(3):
        run([4, 5])
    out["armed"] = _counters()
    # Rank 1 joins while rank 0 tries the cached batch (void on rank 0 only), then both join.
    if rank == 0:
        run([4, 5])
    hvd.join()
    out["after_join"] = _counters()
    for _ in range(40):
        run([4, 5])
    out["end"] = _counters()
    hvd.shutdown()
    return out


def test_ranks_that_tried_a_batch_apart_meet_in_the_cache_again() -> None:
    """The back-off after a fall back is set by the negotiation, the same on every rank: set by
    the void try alone (rank 0 only), it kept the ranks' tries apart for good (none taken)."""
    outs = run_local(_back_in_step, num_proc=2, env=LONG_CYCLE)
    assert [out["armed"] for out in outs] == [(2, 0), (2, 0)]
    assert outs[0]["after_join"] == (2, 1) and outs[1]["after_join"] == (2, 0)
    taken = [out["end"][0] - out["after_join"][0] for out in outs]
    assert taken[0] == taken[1] >= 30, outs  # 40 rounds less a back-off of 4 (+1)
    assert outs[0]["end"][1] == 1 and outs[1]["end"][1] == 0  # no void try since


def _capacity() -> object:
    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init()
    engine = eng.current()
    assert engine is not None
    cache = engine.cache
    hvd.shutdown()
    return None if cache is None else cache.capacity


def test_horovod_cache_capacity_sizes_the_cache_and_zero_turns_it_off() -> None:
    assert run_local(_capacity, 2, env={ev.HOROVOD_CACHE_CAPACITY: "0"}) == [None, None]
    assert run_local(_capacity, 2, env={ev.HOROVOD_CACHE_CAPACITY: "8"}) == [8, 8]
    assert run_local(_capacity, 2) == [64, 64]
