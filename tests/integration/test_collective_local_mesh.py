"""Same-host ranks negotiate over the local mesh (collective/backends/local_mesh.py).

Real rank processes: through the local launcher (torch's TCPStore) and through ``run()`` on the
shared SparkSession (the driver's authenticated store). The ranks count their backend's
``allgather`` calls: with the mesh the negotiation rounds make none, without it one per op. The
results must be the same both ways.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _ops() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = eng.current()
    assert engine is not None
    calls = {"allgather": 0}
    backend_allgather = engine.backend.allgather

    def counted(buf, first_dims):
        calls["allgather"] += 1
        return backend_allgather(buf, first_dims)

    engine.backend.allgather = counted  # type: ignore[method-assign]
    mesh = getattr(engine.backend, "_mesh", None)
    x = torch.arange(6, dtype=torch.float32) * (r + 1)
    big = torch.full((100_000,), float(r))  # beyond the inline room: the backend reduces it
    out = {
        "mesh": mesh is not None,
        "small": hvd.allreduce(x, op=hvd.Sum, name="small").tolist(),
        "big": float(hvd.allreduce(big, name="big")[0]),
        "gathered": hvd.allgather(torch.tensor([r, 10 * r]), name="g").tolist(),
        "bcast": hvd.broadcast(torch.tensor([r + 5.0]), root_rank=n - 1, name="b").tolist(),
    }
    hvd.barrier()
    out["rounds"] = engine.rounds
    out["allgather_calls"] = calls["allgather"]
    hvd.shutdown()
    return out


def _check(outs: list, size: int, mesh: bool) -> None:
    ranks = range(size)
    for out in outs:
        assert out["mesh"] is mesh
        assert out["small"] == [sum(r + 1 for r in ranks) * i for i in range(6)]
        assert out["big"] == pytest.approx(sum(ranks) / size)
        assert out["gathered"] == [v for r in ranks for v in (r, 10 * r)]
        assert out["bcast"] == [size - 1 + 5.0]
        # One allgather of data (hvd.allgather); with no mesh also one per negotiation round.
        assert out["allgather_calls"] == 1 + (0 if mesh else out["rounds"])


@pytest.mark.parametrize("size", [2, 3])
def test_local_launcher_ranks_negotiate_over_the_mesh(size: int) -> None:
    _check(run_local(_ops, num_proc=size), size, mesh=True)


def test_local_mesh_turned_off_keeps_the_backend_path() -> None:
    _check(run_local(_ops, num_proc=2, env={"SPARK_ESTIMATORS_LOCAL_MESH": "0"}), 2, mesh=False)


def test_run_on_spark_uses_the_mesh_through_the_driver_store(spark) -> None:
    from spark_estimators import run

    _check(run(_ops, num_proc=2, verbose=0), 2, mesh=True)
