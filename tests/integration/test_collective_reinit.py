"""``shutdown()`` then ``init()`` again in the same ranks (horovod's tests do it around every test).

The second init failed with EADDRINUSE on rank 0 when anything still referenced the first
group (a failed test's traceback keeping its optimizer alive was enough): rank 0 tried to serve
a new rendezvous store on the port the old one still held.
"""

from __future__ import annotations

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _reinit_while_the_old_group_is_referenced() -> list[float]:
    import torch
    import torch.distributed as dist

    import spark_estimators.collective.torch as hvd

    kept = []
    sums = []
    for i in range(3):
        hvd.init()
        kept.append(dist.distributed_c10d._get_default_group())  # as a traceback would keep it
        x = hvd.allreduce(torch.full((3,), float(hvd.rank() + i)), op=hvd.Sum, name=f"x{i}")
        sums.append(float(x[0]))
        hvd.barrier()
        hvd.shutdown()
    return sums


def test_init_again_after_shutdown_while_the_old_group_is_referenced():
    results = run_local(_reinit_while_the_old_group_is_referenced, num_proc=2, backend="gloo")
    assert results == [[1.0, 3.0, 5.0]] * 2
