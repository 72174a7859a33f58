"""The timeline with 2 real rank processes: enabled by HOROVOD_TIMELINE, by init(timeline=)
and by start_timeline(); each rank's Chrome trace names the ops, their phases and the rank."""

from __future__ import annotations

import io
import json

import pytest

from spark_estimators import envvars as ev
from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _traced(later: str) -> int:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()  # the timeline comes from HOROVOD_TIMELINE
    r = hvd.rank()
    hvd.allreduce(torch.ones(4), name="grad")  # small: travels inline in the negotiation
    hvd.allreduce(torch.ones(50_000), name="big")  # the backend's own allreduce
    hvd.broadcast(torch.ones(3), root_rank=0, name="weights")
    hvd.allgather(torch.ones(1, 2), name="rows")
    hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="async"))  # queued for the engine
    pair = hvd.add_process_set([0, 1])
    hvd.allreduce(torch.ones(2), name="in_set", process_set=pair)
    try:  # a mismatched op is recorded with its error
        hvd.allreduce(torch.ones(2 + r), name="mismatched")
    except Exception:
        pass
    hvd.stop_timeline()
    hvd.start_timeline(later)
    hvd.barrier()
    return r  # no shutdown(): the rank exits with os._exit, the file must be complete anyway


def _events(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def test_timeline_records_ops_phases_and_ranks(tmp_path):
    env = {ev.HOROVOD_TIMELINE: str(tmp_path / "hvd.json"), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    later = str(tmp_path / "later-{rank}.json")
    err = io.StringIO()
    assert run_local(_traced, 2, args=(later,), env=env, backend="gloo", stderr=err) == [0, 1]
    # the ignored Horovod variable is named once, by rank 0
    warned = [line for line in err.getvalue().splitlines() if "MARK_CYCLES" in line]
    assert len(warned) == 1 and warned[0].startswith("[0]"), err.getvalue()[-2000:]
    assert "cycles are not marked" in warned[0]
    for rank in (0, 1):
        events = _events(tmp_path / f"hvd.rank{rank}.json")
        assert {e["pid"] for e in events} == {rank}
        assert events[0] == {"name": "process_name", "ph": "M", "pid": rank,
                             "args": {"name": f"rank {rank}"}}  # fmt: skip
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        ops = [(rows[e["tid"]], e["name"]) for e in events if e["ph"] == "X"]
        for tensor, op in [("grad", "ALLREDUCE"), ("big", "ALLREDUCE"),
                           ("weights", "BROADCAST"), ("rows", "ALLGATHER"),
                           ("in_set", "ALLREDUCE")]:  # fmt: skip
            i = ops.index((tensor, "NEGOTIATE_" + op))
            assert ops[i + 1] == (tensor, op)
        complete = {(e["args"]["tensor"], e["name"]): e for e in events if e["ph"] == "X"}
        queued = [e for e in events if e["name"] == "QUEUE"]
        assert [e["args"]["tensor"] for e in queued] == ["async"]  # blocking ops skip the queue
        assert ops.index(("async", "QUEUE")) + 1 == ops.index(("async", "NEGOTIATE_ALLREDUCE"))
        assert complete[("grad", "ALLREDUCE")]["args"]["inline"] is True
        assert complete[("big", "ALLREDUCE")]["args"]["inline"] is False
        assert complete[("in_set", "ALLREDUCE")]["args"]["process_set"] == 1
        assert complete[("grad", "ALLREDUCE")]["args"]["process_set"] == 0
        assert "mismatched collective op" in complete[("mismatched", "ALLREDUCE")]["args"]["error"]
        negotiate = complete[("big", "NEGOTIATE_ALLREDUCE")]
        run = complete[("big", "ALLREDUCE")]
        assert negotiate["dur"] >= 0 and run["dur"] > 0
        assert run["ts"] >= negotiate["ts"] + negotiate["dur"] - 1  # microseconds, in order
        assert not any(e["name"] == "BARRIER" for e in events)  # stopped before the barrier
        later_events = _events(tmp_path / f"later-{rank}.json")
        assert [e["name"] for e in later_events if e["ph"] == "X"] == [
            "NEGOTIATE_BARRIER", "BARRIER",
        ]  # fmt: skip


def _init_with_timeline(path: str) -> int:
    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init(timeline=path)
    hvd.allreduce(np.ones(3, np.float32), name="x")
    hvd.shutdown()
    return hvd.is_initialized()


def test_init_argument_wins_over_the_environment(tmp_path):
    env = {ev.HOROVOD_TIMELINE: str(tmp_path / "env.json")}
    run_local(_init_with_timeline, 2, args=(str(tmp_path / "arg.json"),), env=env, backend="gloo")
    assert not (tmp_path / "env.rank0.json").exists()
    for rank in (0, 1):
        names = [e["name"] for e in _events(tmp_path / f"arg.rank{rank}.json")]
        assert names[-2:] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]


def _dynamic(later: str) -> dict:
    import os

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    os.chdir(os.path.dirname(later))  # where a file named after the variable would land
    hvd.init()  # HOROVOD_TIMELINE=DYNAMIC: no timeline yet
    engine = eng.current()
    assert engine is not None
    out = {"at_init": engine.timeline is not None, "files_at_init": sorted(os.listdir("."))}
    hvd.allreduce(torch.ones(2), name="before")
    hvd.start_timeline(later)
    handles = [hvd.allreduce_async_(torch.ones(3), name=f"g{i}") for i in range(3)]
    for h in handles:
        hvd.synchronize(h)
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(2), name="after")
    hvd.shutdown()
    out["files"] = sorted(os.listdir("."))
    return out


def test_dynamic_timeline_starts_only_through_the_api(tmp_path):
    """``HOROVOD_TIMELINE=DYNAMIC`` (Horovod's "start later") is not a file name."""
    env = {ev.HOROVOD_TIMELINE: "DYNAMIC", ev.HOROVOD_CYCLE_TIME: "600000"}
    later = str(tmp_path / "api.json")
    outs = run_local(_dynamic, 2, args=(later,), env=env, backend="gloo")
    for rank, out in enumerate(outs):
        assert out["at_init"] is False, rank
        assert out["files_at_init"] == [], rank  # no DYNAMIC.rank<N>.json
        assert not any("DYNAMIC" in f for f in out["files"]), out["files"]
        events = [e for e in _events(tmp_path / f"api.rank{rank}.json") if e["ph"] == "X"]
        tensors = {e["args"]["tensor"] for e in events}
        assert tensors == {"g0", "g1", "g2"}, tensors  # neither "before" nor "after"
        ops = [e for e in events if e["name"] == "ALLREDUCE"]
        assert [e["args"]["fused"] for e in ops] == [3, 3, 3]  # one fused round, per tensor
