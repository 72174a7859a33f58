"""run(): the MASTER_PORT rank 0 advertises is held from the moment it is advertised.

Before, each task probed a port (bind port 0, read, close) and rank 0's store bound it only
after its rank process had started; another job could take the port in between, and two
concurrent ``run()`` jobs sometimes failed in gloo's join with "Connection reset by peer".
Here every rank binds the advertised port as an outsider would, before any store exists:
EADDRINUSE now, a successful bind before. Then the real gloo job on that port must work.
"""

from __future__ import annotations

import pytest

import spark_estimators

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _held_then_allreduce() -> dict:
    import errno
    import os
    import socket

    import numpy as np

    import spark_estimators.collective as hvd

    port = int(os.environ["MASTER_PORT"])
    refused = []
    for host in ("", "127.0.0.1"):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host, port))
            refused.append(False)
        except OSError as exc:
            refused.append(exc.errno == errno.EADDRINUSE)
        finally:
            probe.close()
    hvd.init()
    try:
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
        return {"rank": hvd.rank(), "port": port, "refused": refused, "sum": float(total[0])}
    finally:
        hvd.shutdown()


def test_rank_0_port_is_held_when_advertised_and_its_store_binds_it(spark):
    out = spark_estimators.run(_held_then_allreduce, num_proc=2, spark=spark, backend="gloo")
    assert [r["rank"] for r in out] == [0, 1]
    assert out[0]["port"] == out[1]["port"]
    assert [r["refused"] for r in out] == [[True, True], [True, True]]
    assert [r["sum"] for r in out] == [3.0, 3.0]
