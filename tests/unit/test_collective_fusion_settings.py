"""Fusion settings and the negotiation plan, in one process.

The cycle time (``SPARK_ESTIMATORS_CYCLE_TIME`` over Horovod's ``HOROVOD_CYCLE_TIME``), the
timeline's ``DYNAMIC`` value, and how the ranks' negotiation vectors decide which queued
allreduces run fused (the agreed prefix), built from real requests and stacked as the
allgather would return them.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators import envvars as ev
from spark_estimators.collective.runtime import negotiation as neg
from spark_estimators.collective.runtime import settings
from spark_estimators.collective.runtime.requests import Fusion, Kind, Request
from spark_estimators.errors import ConfigurationError


@pytest.fixture
def env(monkeypatch):
    for name in (ev.CYCLE_TIME, ev.HOROVOD_CYCLE_TIME, ev.TIMELINE, ev.HOROVOD_TIMELINE):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cycle_time_default_horovod_and_ours(env):
    assert settings.cycle_time() == 1.0  # Horovod's default since 0.21
    env.setenv(ev.HOROVOD_CYCLE_TIME, "3.5")
    assert settings.cycle_time() == 3.5
    env.setenv(ev.CYCLE_TIME, "0")  # ours wins
    assert settings.cycle_time() == 0.0
    assert settings.cycle_time(7) == 7.0  # an argument wins over both
    assert ev.HOROVOD_CYCLE_TIME not in ev.IGNORED_HOROVOD


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_bad_cycle_time_names_the_variable(env, raw):
    env.setenv(ev.HOROVOD_CYCLE_TIME, raw)
    with pytest.raises(ConfigurationError, match="HOROVOD_CYCLE_TIME"):
        settings.cycle_time()


@pytest.mark.parametrize("value", ["DYNAMIC", "dynamic", " DYNAMIC "])
def test_dynamic_timeline_is_no_path(env, value):
    env.setenv(ev.HOROVOD_TIMELINE, value)
    assert settings.timeline_path() is None
    env.setenv(ev.TIMELINE, "/tmp/tl.json")  # ours wins
    assert settings.timeline_path() == "/tmp/tl.json"
    assert settings.timeline_path("DYNAMIC") is None
    assert settings.timeline_path("/tmp/arg.json") == "/tmp/arg.json"


def _request(shape: tuple[int, ...], name: str | None = None, fill: float = 1.0) -> Request:
    data = np.full(shape, fill, dtype=np.float32)
    signature = (Kind.ALLREDUCE.name, name, "float32", "cpu", (shape,), "SUM", 1.0, 1.0)
    return Request(
        Kind.ALLREDUCE, name or "x", signature, lambda a: None, "x", numel=data.size,
        inline=lambda: data.view(np.uint8).reshape(-1),
        fusion=Fusion(("f",), data.nbytes, lambda rs, a: []),
    )  # fmt: skip


def _round(batches: list[list[Request]], limit: int = 1 << 20):
    """Every rank's vector for its batch, gathered; and the plan each rank computes."""
    sides = [neg.Negotiation(limit) for _ in batches]
    vectors = np.stack([side.vector(batch) for side, batch in zip(sides, batches, strict=True)])
    plans = [side.plan(vectors, range(len(batches))) for side in sides]
    assert all(p == plans[0] for p in plans)  # every rank decides the same
    return sides, vectors, plans[0]


def test_plan_is_the_common_prefix():
    a, b, c = (4,), (5,), (6,)
    # Rank 1 has queued fewer ops so far: the prefix both listed runs now.
    _, _, plan = _round([[_request(a), _request(b), _request(c)], [_request(a), _request(b)]])
    assert (plan.count, plan.numel) == (2, 9)
    # Rank 1 swapped b and c: only a runs, the next round's heads differ (a mismatch error).
    _, _, plan = _round([[_request(a), _request(b), _request(c)],
                         [_request(a), _request(c), _request(b)]])  # fmt: skip
    assert (plan.count, plan.numel) == (1, 4)


def test_inline_only_when_every_rank_sent_the_whole_agreed_batch():
    small = [[_request((8,), fill=r + 1.0) for _ in range(3)] for r in range(2)]
    sides, vectors, plan = _round(small)
    assert (plan.count, plan.inline) == (3, True)  # 3 x 32 bytes fit the 512-byte room
    rows = sides[0].payloads(vectors)
    got = rows[:, : 3 * 32].view(np.float32)
    np.testing.assert_array_equal(got, [[1.0] * 24, [2.0] * 24])
    big = [[_request((100,)) for _ in range(3)] for _ in range(2)]  # 1200 bytes > 512
    _, _, plan = _round(big)
    assert (plan.count, plan.inline) == (3, False)


def test_a_batch_that_does_not_fit_whole_packs_nothing():
    # 2 x 200 bytes fit the 512-byte room, 3 do not: that rank packs none of them (no copy per
    # op every round), so a round whose agreed prefix would fit runs through the backend.
    two = [_request((50,)) for _ in range(2)]
    three = [_request((50,)) for _ in range(3)]
    side = neg.Negotiation(1 << 20)
    assert side.vector(two)[neg.INLINE] == 2
    assert side.vector(three)[neg.INLINE] == 0
    assert side.vector(three)[neg.WANT] == 600  # still asks for the room it would need
    _, _, plan = _round([two, three])
    assert (plan.count, plan.inline) == (2, False)
    _, _, plan = _round([two, list(two)])
    assert (plan.count, plan.inline) == (2, True)


def test_slots_and_room_grow_from_the_gathered_wishes_and_agree():
    batches = [[_request((2,)) for _ in range(100)] for _ in range(2)]
    sides, vectors, plan = _round(batches)
    assert plan.count == neg.MIN_SLOTS  # the first vectors list 64 requests
    for side in sides:
        side.update(vectors)
    assert [s.slots for s in sides] == [100, 100]
    assert [s.room for s in sides] == [512, 512]  # 64 x 8 bytes: the fixed room already fits
    # The plan still reads the round that was sent with 64 slots.
    assert sides[0].plan(vectors, [0, 1]).count == neg.MIN_SLOTS
    # Rounds of single ops (blocking allreduces, metrics) do not shrink the slots...
    for _ in range(2 * neg.ROOM_WINDOW):
        single = np.stack([side.vector([_request((2,))]) for side in sides])
        for side in sides:
            side.update(single)
    assert [s.slots for s in sides] == [100, 100]
    # ... rounds that fuse fewer ops do, after a window of them.
    for _ in range(neg.ROOM_WINDOW):
        pair = np.stack([side.vector([_request((2,)), _request((2,))]) for side in sides])
        for side in sides:
            side.update(pair)
    assert [s.slots for s in sides] == [neg.MIN_SLOTS] * 2
