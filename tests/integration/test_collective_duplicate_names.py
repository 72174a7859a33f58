"""A second in-flight op with the name of one still pending is refused (issue 44 item 3).

Horovod refuses it (``test_horovod_*_duplicate_name_error`` expect a ``ValueError`` on the rank
that submits it); before, ours accepted it and ran both. The first op still completes, the name
is free again once it has, and the group stays usable.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _duplicates() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as _engine
    from spark_estimators.errors import CollectiveError

    hvd.init()
    seen: dict = {}
    for op in ("allreduce", "allgather", "broadcast"):
        submit = {
            "allreduce": lambda t, n: hvd.allreduce_async(t, name=n, op=hvd.Sum),
            "allgather": lambda t, n: hvd.allgather_async(t, name=n),
            "broadcast": lambda t, n: hvd.broadcast_async(t, root_rank=0, name=n),
        }[op]
        tensor = torch.full((3,), float(hvd.rank() + 1))

        def submit_twice(submit=submit, tensor=tensor, name=f"dup.{op}"):
            first = submit(tensor, name)
            try:
                submit(tensor, name)
                return first, "accepted"
            except ValueError as exc:
                return first, str(exc)

        # Under the engine's lock no batch runs, so the first op is still in flight when the
        # second is submitted (without it, a rank descheduled between the two submissions could
        # see the first done and its name free: flaky under load).
        engine = _engine.require("test", None)
        first, seen[op] = engine.run_exclusive(submit_twice, lambda e: CollectiveError(str(e)))
        result = hvd.synchronize(first)
        seen[op + ".result"] = result.tolist()
        again = submit(tensor, f"dup.{op}")  # the name is free once the first op is done
        seen[op + ".again"] = hvd.synchronize(again).tolist()
    return seen


def test_a_second_op_with_a_pending_name_is_refused_and_the_first_completes():
    zero, one = run_local(_duplicates, num_proc=2, backend="gloo")
    for seen in (zero, one):
        assert isinstance(seen, dict), seen
        for op in ("allreduce", "allgather", "broadcast"):
            assert "still in flight on this rank" in seen[op], seen[op]
            assert f"'dup.{op}'" in seen[op]
        assert seen["allreduce.result"] == [3.0, 3.0, 3.0] == seen["allreduce.again"]
        assert seen["allgather.result"] == [1.0] * 3 + [2.0] * 3 == seen["allgather.again"]
        assert seen["broadcast.result"] == [1.0, 1.0, 1.0] == seen["broadcast.again"]
