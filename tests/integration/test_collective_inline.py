"""The negotiation's growing inline room, with 2 real processes on 127.0.0.1.

An allreduce that fits the room travels inside the negotiation allgather (one round trip, no
backend allreduce); the room follows the largest recent allreduce up to the inline limit. The
ranks count their backend's ``allreduce`` calls to tell the two paths apart.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

N = 1024  # float32 elements: 4 KiB, above the fixed 512-byte room


def _inline_suite() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng
    from spark_estimators.collective.runtime import negotiation as neg
    from spark_estimators.errors import CollectiveError

    hvd.init()
    r = hvd.rank()
    engine = eng.current()
    assert engine is not None
    calls = {"allreduce": 0}
    backend_allreduce = engine.backend.allreduce

    def counted(buf, op):
        calls["allreduce"] += 1
        return backend_allreduce(buf, op)

    engine.backend.allreduce = counted  # type: ignore[method-assign]
    out: dict = {"room0": engine.inline_room}
    x = torch.arange(N, dtype=torch.float32) * (r + 1)

    # First 4 KiB allreduce: too big for the room, so the backend reduces it; the room grows.
    out["first"] = hvd.allreduce(x, op=hvd.Sum, name="x").numpy()
    out["calls_first"] = calls["allreduce"]
    out["room1"] = engine.inline_room
    # Now the same op travels inline (no backend call), with the same result.
    out["second"] = hvd.allreduce(x, op=hvd.Sum, name="x").numpy()
    out["avg"] = hvd.allreduce(x, name="x_avg").numpy()
    out["calls_second"] = calls["allreduce"]

    # A mismatch with a grown room is still caught from the header, and the group survives.
    bad = torch.ones(N if r == 0 else N // 2)
    try:
        hvd.allreduce(bad, name="mismatch")
        out["mismatch"] = None
    except CollectiveError as exc:
        out["mismatch"] = str(exc)
    out["after_mismatch"] = hvd.allreduce(x, op=hvd.Sum, name="x").numpy()

    # join: rank 1 stops early; rank 0's inline allreduces average with rank 1's zeros.
    if r == 0:
        out["join_avg"] = hvd.allreduce(torch.full((N,), 4.0), name="tail").numpy()
        out["calls_join"] = calls["allreduce"]
    out["join_last"] = hvd.join()

    # Small ops only: after ROOM_WINDOW rounds the room is back to the fixed size.
    for _ in range(neg.ROOM_WINDOW):
        hvd.allreduce(torch.ones(2), name="small")
    out["room_decayed"] = engine.inline_room
    out["calls_end"] = calls["allreduce"]
    hvd.shutdown()
    return out


def _limits_suite() -> dict:
    """Ranks with different inline limits agree on the smallest: no op is sent inline above it."""
    import os

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    rank = int(os.environ["SPARK_ESTIMATORS_RANK"])
    os.environ["SPARK_ESTIMATORS_INLINE_LIMIT"] = "65536" if rank == 0 else "2048"
    hvd.init()
    engine = eng.current()
    assert engine is not None
    x = torch.ones(N) * (rank + 1)
    results = [hvd.allreduce(x, op=hvd.Sum, name="x").numpy() for _ in range(3)]
    room = engine.inline_room
    small = torch.ones(400) * (rank + 1)  # 1600 bytes: under both limits
    hvd.allreduce(small, op=hvd.Sum, name="small")
    out = {"results": results, "room_after_big": room, "room_after_small": engine.inline_room}
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def inline():
    # The negotiation's room and backend calls: without the response cache (its own tests).
    return run_local(_inline_suite, num_proc=2, env={"SPARK_ESTIMATORS_STEADY_ALLREDUCE": "0"})


def test_room_grows_after_the_first_large_allreduce(inline):
    import numpy as np

    expected = np.arange(N, dtype=np.float32) * 3  # ranks contribute x * 1 and x * 2
    for r, out in enumerate(inline):
        assert out["room0"] == 512, r
        assert out["calls_first"] == 1, r  # the backend reduced the first one
        assert out["room1"] == N * 4, r
        np.testing.assert_array_equal(out["first"], expected)
        np.testing.assert_array_equal(out["second"], expected)
        np.testing.assert_allclose(out["avg"], expected / 2, rtol=1e-6)
        assert out["calls_second"] == 1, r  # ... and not the two after it (inline)


def test_mismatch_is_reported_with_a_grown_room(inline):
    import numpy as np

    for out in inline:
        assert "mismatched collective op for 'mismatch'" in out["mismatch"]
        assert "rank 0: allreduce 'mismatch' float32 on cpu, shape (1024,)" in out["mismatch"]
        assert "rank 1: allreduce 'mismatch' float32 on cpu, shape (512,)" in out["mismatch"]
        np.testing.assert_array_equal(out["after_mismatch"], np.arange(N, dtype=np.float32) * 3)


def test_join_contributes_zeros_inline_and_room_decays(inline):
    import numpy as np

    np.testing.assert_allclose(inline[0]["join_avg"], np.full(N, 2.0))
    assert inline[0]["calls_join"] == 1  # inline: no backend allreduce since the first
    assert [out["join_last"] for out in inline] == [0, 0]
    assert [out["room_decayed"] for out in inline] == [512, 512]
    assert [out["calls_end"] for out in inline] == [1, 1]


def test_ranks_agree_on_the_smallest_inline_limit():
    import numpy as np

    outs = run_local(_limits_suite, num_proc=2)
    for out in outs:
        for got in out["results"]:
            np.testing.assert_array_equal(got, np.full(N, 3.0, dtype=np.float32))
        assert out["room_after_big"] == 512  # 4 KiB is above rank 1's 2 KiB limit
        assert out["room_after_small"] == 1600
