"""Issue 27 item 9: a process without the job's secret cannot join or corrupt a run's group.

Before the fix rank 0 served torch's TCPStore on MASTER_PORT: the intruder below (a separate
process with the rank's environment but not the secret) connected, listed and wrote keys.
"""

from __future__ import annotations

import pytest

import spark_estimators

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(240)]

_INTRUDER = r"""
import json, os, sys, datetime
out = {}
try:
    import torch.distributed as dist
    s = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2,
                      is_master=False, timeout=datetime.timedelta(seconds=2))
    s.set("intruder", "was here")
    out["tcpstore"] = "joined: %d keys" % s.num_keys()
except Exception as exc:
    out["tcpstore"] = "refused: " + type(exc).__name__
from spark_estimators.driver.rpc import RpcClient
host, port = sys.argv[1], int(sys.argv[2])
try:
    with RpcClient((host, port), os.urandom(32), timeout=5) as c:
        out["driver"] = "joined: %r" % (c.call("store", ("list_keys", sys.argv[3], ())),)
except Exception as exc:
    out["driver"] = "refused: " + type(exc).__name__
print(json.dumps(out))
"""


def _attacked_rank(init: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    import torch
    import torch.distributed as dist

    from spark_estimators import collective
    from spark_estimators.task import context

    if init == "collective":
        collective.init(backend="gloo")
        rank = collective.rank()
    else:  # the env:// path Lightning's DDP strategy and plain user code take
        dist.init_process_group("gloo", init_method="env://")
        rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    report: dict = {"before": t.item()}
    if rank == 0:
        host, port = context.driver_client().address
        env = {k: v for k, v in os.environ.items()}
        # The first rendezvous of this process at the job's point (driver/store_client.py).
        ns = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/2/1"
        proc = subprocess.run(
            [sys.executable, "-c", _INTRUDER, host, str(port), ns],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )  # fmt: skip
        report.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        # The group's keys are in the driver's store, reached with the secret.
        report["driver_keys"] = context.driver_client().call("store", ("list_keys", ns, ()))
    dist.barrier()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the group still works after the attempt
    report["after"] = t.item()
    if init == "collective":
        collective.shutdown()
    else:
        dist.destroy_process_group()
    return report


@pytest.mark.parametrize("init", ["collective", "env"])
def test_intruder_without_the_secret_cannot_reach_the_rendezvous(spark, init):
    out = spark_estimators.run(_attacked_rank, args=(init,), num_proc=2, spark=spark)
    rank0, rank1 = out
    assert rank0["tcpstore"].startswith("refused"), rank0
    assert rank0["driver"] == "refused: RpcError", rank0
    assert any("cpu" in k for k in rank0["driver_keys"]), rank0  # gloo's address keys
    assert [r["before"] for r in out] == [3.0, 3.0]
    assert [r["after"] for r in out] == [3.0, 3.0]
