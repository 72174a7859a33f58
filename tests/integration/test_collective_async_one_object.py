"""``allreduce_async_`` of one tensor is one object (issue 45, session 5), 2 real processes.

The per-tensor path returns an
:class:`~spark_estimators.collective.runtime.allreduce.AllreduceOp`: the engine's request, its
own future and the caller's handle in one object. These cases check what the caller and the
engine see through it: sums right and each handle giving back its own tensor whatever the order
of the ``synchronize`` calls, done callbacks run in submission order, ``poll`` driving an op to
completion alone, ``then``, the timeline naming the ops, a joined rank's zeros, and errors that
name the op (a mismatch of an unnamed op names its generated name; a broken group fails the next
op with its name).
"""

from __future__ import annotations

import json
import time

import pytest

from spark_estimators.launch import run_local

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

N = 40


def _one_object(timeline: str) -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng
    from spark_estimators.collective.runtime.allreduce import AllreduceOp
    from spark_estimators.collective.runtime.futures import Handle
    from spark_estimators.errors import CollectiveError

    hvd.init(timeline=timeline)
    r = hvd.rank()
    out: dict = {"rank": r}

    # 40 ops, some named: synchronize in reverse order; each returns its own tensor, summed.
    ts = [torch.full((i % 5 + 1,), float(i + r)) for i in range(N)]
    settled: list[int] = []
    handles = []
    for i, t in enumerate(ts):
        h = hvd.allreduce_async_(t, name=f"g{i}" if i % 3 == 0 else None, op=hvd.Sum)
        h.add_done_callback(lambda f, i=i: settled.append(i))
        handles.append(h)
    h0 = handles[0]
    out["types"] = sorted({type(h).__name__ for h in handles})
    out["one_object"] = (
        isinstance(h0, Handle) and isinstance(h0, AllreduceOp) and h0.future is h0
    )  # fmt: skip
    out["same_tensor"] = all(hvd.synchronize(h) is t for h, t in reversed(list(zip(handles, ts))))
    out["sums"] = [t.tolist() for t in ts]
    out["settled"] = settled
    out["results"] = [h.result()[0] is t for h, t in zip(handles, ts)]
    out["names"] = [h.name for h in handles[:3]]

    # poll alone (nobody waits): the engine runs it; then() maps the caller's tensor.
    p = torch.full((3,), float(r + 1))
    h = hvd.allreduce_async_(p, op=hvd.Sum)
    started = time.monotonic()
    while not hvd.poll(h) and time.monotonic() - started < 30:
        pass
    out["polled"] = (hvd.poll(h), p.tolist())
    out["then"] = hvd.allreduce_async_(torch.ones(2), op=hvd.Sum).then(lambda x: x * 10).wait()
    out["then"] = out["then"].tolist()

    # A mismatch of an unnamed op names its generated name and both shapes, on every rank.
    try:
        hvd.synchronize(hvd.allreduce_async_(torch.ones(3 + r), op=hvd.Sum))
        out["mismatch"] = "accepted"
    except CollectiveError as exc:
        out["mismatch"] = str(exc)
    out["after"] = hvd.synchronize(hvd.allreduce_async_(torch.ones(2), op=hvd.Sum)).tolist()

    # A joined rank contributes zeros to the other's per-tensor async ops (Average over 2).
    if r == 1:
        out["last_joined"] = hvd.join()
    else:
        js = [torch.full((4,), 6.0) for _ in range(5)]
        for jh in [hvd.allreduce_async_(j, name=f"j{i}") for i, j in enumerate(js)]:
            hvd.synchronize(jh)
        out["joined_avg"] = [j.tolist() for j in js]
        out["last_joined"] = hvd.join()
    hvd.stop_timeline()

    # A broken group (as after a backend error): the next op fails with an error naming it.
    engine = eng.current()
    assert engine is not None
    engine._broken = CollectiveError("the group broke (set by the test)")
    try:
        hvd.synchronize(hvd.allreduce_async_(torch.ones(2), name="after_break", op=hvd.Sum))
        out["broken"] = "accepted"
    except CollectiveError as exc:
        out["broken"] = str(exc)
    engine._broken = None
    hvd.shutdown()
    return out


def test_per_tensor_async_allreduce_is_one_object_with_the_semantics(tmp_path):
    path = str(tmp_path / "t.json")
    zero, one = run_local(_one_object, 2, args=(path,), backend="gloo")
    for out in (zero, one):
        assert isinstance(out, dict), out
        r = out["rank"]
        assert out["types"] == ["AllreduceOp"]
        assert out["one_object"]
        assert out["same_tensor"]
        assert out["sums"] == [[float(2 * i + 1)] * (i % 5 + 1) for i in range(N)]
        assert out["settled"] == list(range(N))  # callbacks in submission order, each once
        assert all(out["results"])
        assert out["names"][0] == "g0" and out["names"][1].startswith("allreduce.noname.")
        assert out["polled"] == (True, [3.0, 3.0, 3.0])
        assert out["then"] == [20.0, 20.0]
        assert "mismatched collective op for 'allreduce.noname." in out["mismatch"], out
        assert "shape (3,)" in out["mismatch"] and "shape (4,)" in out["mismatch"]
        assert out["after"] == [2.0, 2.0]
        assert out["last_joined"] == 0  # rank 0 joined after its ops
        if r == 0:
            assert out["joined_avg"] == [[3.0] * 4] * 5  # (6 + 0) / 2
        assert "'after_break'" in out["broken"] and "broke" in out["broken"], out["broken"]
        with open(tmp_path / f"t.rank{r}.json", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert all(f"g{i}" in rows for i in range(0, N, 3))
        if r == 0:
            assert {f"j{i}" for i in range(5)} <= rows
