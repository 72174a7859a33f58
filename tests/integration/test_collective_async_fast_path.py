"""The per-tensor ``allreduce_async_`` path (issue 45), 2 real processes on 127.0.0.1.

``allreduce_async_`` of one contiguous tensor skips the grouped machinery: what its requests
share is computed once per engine (``engine.statics``) and each call makes one request. These
cases check that it keeps Horovod's semantics: results in place in the caller's tensor (also a
leaf that requires grad), the scale factors and integer averaging, a kept signature that still
catches a shape that differs across ranks (and a new shape on a later step), a dtype/op refused
before anything is sent, duplicate names refused while in flight, process sets, and fused
batches of tensors of several shapes (the packed buffer's split back into them).
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _fast_path() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng
    from spark_estimators.collective.runtime.allreduce import _FusedPart
    from spark_estimators.collective.runtime.requests import signature_hash
    from spark_estimators.errors import CollectiveError, ConfigurationError

    hvd.init()
    r = hvd.rank()
    engine = eng.current()
    assert engine is not None
    out: dict = {"rank": r}

    # The handle returns the caller's tensor, reduced in place; twice with one kept static.
    for step in range(2):
        t = torch.full((4,), float(r + 1 + step))
        got = hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))
        out[f"same_object.{step}"] = got is t
        out[f"sum.{step}"] = t.tolist()
    out["statics_after_repeat"] = len(engine.statics)
    static = next(iter(engine.statics.values()))
    request = static.request("x", _FusedPart(static, [t], [t]))
    out["hash_ok"] = request.signature_hash == signature_hash(static.signature)
    out["description"] = request.description

    # Average (the default), scale factors, integers (averaged in float64, truncated).
    avg = torch.full((3,), 1.0 + 2 * r)
    hvd.synchronize(hvd.allreduce_async_(avg))
    scaled = torch.full((3,), 1.0 + r)
    hvd.synchronize(hvd.allreduce_async_(scaled, op=hvd.Sum, prescale_factor=2.0,
                                         postscale_factor=0.5))  # fmt: skip
    ints = torch.full((3,), 2 + r, dtype=torch.int32)  # (2 + 3) / 2 = 2.5 -> 2
    hvd.synchronize(hvd.allreduce_async_(ints, op=hvd.Average))
    out["avg"], out["scaled"], out["ints"] = avg.tolist(), scaled.tolist(), ints.tolist()

    # A leaf that requires grad (a parameter's .grad owner): reduced through a detached view.
    leaf = torch.full((2,), float(r + 1), requires_grad=True)
    hvd.synchronize(hvd.allreduce_async_(leaf, op=hvd.Sum))
    out["leaf"], out["leaf_requires_grad"] = leaf.tolist(), leaf.requires_grad

    # Not contiguous: the grouped form takes it, still in place.
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2) * (r + 1)
    column = base[:, 1]
    hvd.synchronize(hvd.allreduce_async_(column, op=hvd.Sum))
    out["column"], out["base"] = column.tolist(), base.tolist()

    # One fused batch of several shapes: each tensor gets its own part back.
    shapes = [(3,), (2, 2), (1, 2, 3), (5,), ()]
    ts = [torch.full(s, float(i + 1) * (r + 1)) for i, s in enumerate(shapes)]
    for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in ts]:
        hvd.synchronize(h)
    out["shapes"] = [t.tolist() for t in ts]

    # A shape that differs across ranks: every rank raises, and the group keeps working;
    # also after this shape's static was kept by a matching first step.
    for step in range(2):
        odd = torch.ones(4 + (r if step else 0))
        try:
            hvd.synchronize(hvd.allreduce_async_(odd, name="odd", op=hvd.Sum))
            out[f"odd.{step}"] = odd.tolist()
        except CollectiveError as exc:
            out[f"odd.{step}"] = str(exc)
    out["after_mismatch"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()

    # Refused before anything is sent (every rank alike): a bool Average, a bad op.
    try:
        hvd.allreduce_async_(torch.ones(2, dtype=torch.bool))
        out["bool"] = "accepted"
    except ConfigurationError as exc:
        out["bool"] = str(exc)
    try:
        hvd.allreduce_async_(torch.ones(2), op=17)
        out["bad_op"] = "accepted"
    except ConfigurationError as exc:
        out["bad_op"] = str(exc)

    # A name still in flight is refused; it is free again once the op has settled.
    first = hvd.allreduce_async_(torch.ones(2), name="dup", op=hvd.Sum)
    try:
        hvd.allreduce_async_(torch.ones(2), name="dup", op=hvd.Sum)
        out["dup"] = "accepted"
    except ValueError as exc:
        out["dup"] = str(exc)
    out["dup.first"] = hvd.synchronize(first).tolist()
    out["dup.again"] = hvd.synchronize(
        hvd.allreduce_async_(torch.ones(2), name="dup", op=hvd.Sum)
    ).tolist()

    # A process set: its own engine and statics.
    pair = hvd.add_process_set([0, 1])
    in_set = torch.full((2,), float(r + 1))
    hvd.synchronize(hvd.allreduce_async_(in_set, op=hvd.Sum, process_set=pair))
    out["set"] = in_set.tolist()
    hvd.shutdown()
    return out


def test_per_tensor_async_allreduce_keeps_horovods_semantics():
    zero, one = run_local(_fast_path, num_proc=2, backend="gloo")
    for out in (zero, one):
        assert isinstance(out, dict), out
        assert out["same_object.0"] and out["same_object.1"]
        assert out["sum.0"] == [3.0] * 4 and out["sum.1"] == [5.0] * 4
        assert out["statics_after_repeat"] == 1  # both steps used one kept static
        assert out["hash_ok"]
        assert out["description"] == "'x' float32 on cpu, shape (4,), op=SUM"
        assert out["avg"] == [2.0] * 3
        assert out["scaled"] == [3.0] * 3  # 0.5 * (2 * 1 + 2 * 2)
        assert out["ints"] == [2] * 3
        assert out["leaf"] == [3.0, 3.0] and out["leaf_requires_grad"]
        assert out["column"] == [3.0, 9.0, 15.0]
        k = out["rank"] + 1  # column 0 is this rank's own, untouched
        assert out["base"] == [[0.0, 3.0], [2.0 * k, 9.0], [4.0 * k, 15.0]]
        assert out["shapes"][0] == [3.0] * 3
        assert out["shapes"][1] == [[6.0, 6.0], [6.0, 6.0]]
        assert out["shapes"][2] == [[[9.0] * 3, [9.0] * 3]]
        assert out["shapes"][3] == [12.0] * 5
        assert out["shapes"][4] == 15.0
        assert out["odd.0"] == [2.0] * 4
        assert "mismatched collective op for 'odd'" in out["odd.1"], out["odd.1"]
        assert "shape (4,)" in out["odd.1"] and "shape (5,)" in out["odd.1"]
        assert out["after_mismatch"] == [2.0, 2.0]
        assert "op=Average" in out["bool"] and "allreduce.noname." in out["bool"], out["bool"]
        assert "17" in out["bad_op"], out["bad_op"]
        assert "'dup'" in out["dup"] and "still in flight" in out["dup"], out["dup"]
        assert out["dup.first"] == [2.0, 2.0] == out["dup.again"]
        assert out["set"] == [3.0, 3.0]


def _two_threads() -> dict:
    import threading
    import time

    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    stalled: list[float] = []

    def blocking() -> None:
        t = torch.ones(8)
        for _ in range(ROUNDS):
            hvd.allreduce_(t, op=hvd.Sum)  # runs in this thread while the queue is empty

    def polling() -> None:
        u = torch.ones(8)
        for _ in range(ROUNDS):
            handle = hvd.allreduce_async_(u, op=hvd.Sum)
            started = time.monotonic()
            while not hvd.poll(handle):  # nobody waits: only the engine thread can run it
                if time.monotonic() - started > 20:
                    stalled.append(time.monotonic() - started)
                    hvd.synchronize(handle)
                    break

    threads = [threading.Thread(target=blocking), threading.Thread(target=polling)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    hvd.shutdown()
    return {"stalled": stalled}


ROUNDS = 300


def test_an_op_queued_while_another_thread_runs_one_is_run_by_the_engine():
    # One rank (ops from two threads need no order across ranks): while a blocking allreduce
    # runs in its caller's thread, the engine thread sleeps rather than wait for the lock; it
    # must be woken for the async op queued meanwhile, which only it can run (the submitting
    # thread just polls).
    (out,) = run_local(_two_threads, num_proc=1, backend="gloo")
    assert out == {"stalled": []}
