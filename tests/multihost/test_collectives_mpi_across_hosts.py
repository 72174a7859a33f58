"""MPI across hosts: inside Spark (``run(fn, backend="mpi")``) and under the mpich wheel's mpiexec.

Inside Spark the ranks are started by their Spark tasks and wired by the driver's PMI-1 server
(docs/mpi.md), not by ``mpiexec``: MPICH's own data path then carries the traffic between the
hosts' addresses, and its process mapping (from the host hashes) puts two ranks on each node.
Outside Spark, hydra's ``mpiexec`` on host1 starts its proxies on host2 and host3 through its
ssh launcher, here a script that enters the host's namespace (no sshd runs in the harness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

SIZE = 6


def test_mpi_world_spans_the_three_hosts_with_exact_results(cluster, agent) -> None:
    answer = agent.call("mpi", timeout=400)
    assert "error" not in answer, answer.get("tb")
    ranks = answer["ranks"]
    assert [r["rank"] for r in ranks] == list(range(SIZE))
    hosts = [r["hostname"] for r in ranks]
    assert sorted(set(hosts)) == sorted(h.hostname for h in cluster.hosts)
    for r in ranks:
        assert r["backend"] == "mpi"
        assert r["world"] == [r["rank"], SIZE]  # MPI's rank is ours
        assert r["local_size"] == 2 and r["cross_size"] == 3
        assert r["local_rank"] == r["rank"] % 2
        assert hosts[r["rank"]] == hosts[r["rank"] - r["local_rank"]]  # contiguous per host
        assert r["node_size"] == 2  # MPICH's shared-memory node: this host's two ranks
        assert r["allreduce"] == [float(sum(range(1, SIZE + 1)) * i) for i in range(4)]
        assert r["allreduce_big"] == float(sum(range(SIZE)))
        assert r["allgather"] == [[i, 10 * i] for i in range(SIZE)]
        assert r["broadcast"] == [SIZE - 1 + 0.5]
        assert r["raw_allreduce"] == sum(range(1, SIZE + 1))


LAUNCHER = """#!/bin/sh
# hydra's ssh launcher runs: <this> [-x] <host> <command line>; enter <host> instead of ssh.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%s
  *) echo "no harness host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts -- sh -c "hostname $host && $*"
"""

RANK_SCRIPT = """
import json, socket, sys
import numpy as np
import spark_estimators.collective as hvd
hvd.init(backend="mpi")
total = hvd.allreduce(np.full(1_000_000, hvd.rank() + 1.0), op=hvd.Sum)
with open(f"{sys.argv[1]}/{hvd.rank()}.json", "w") as f:  # mpiexec interleaves stdout
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(), "host": socket.gethostname(),
        "sum": [float(total.min()), float(total.max())]}, f)
hvd.shutdown()
"""


def test_mpiexec_of_the_mpich_wheel_starts_ranks_on_two_other_hosts(cluster) -> None:
    launcher = Path(cluster.workdir, "enter-host")
    launcher.write_text(
        LAUNCHER % "\n".join(f"  {h.hostname}) ns={h.netns} ;;" for h in cluster.hosts)
    )
    launcher.chmod(0o755)
    script = Path(cluster.workdir, "mpi_rank.py")
    script.write_text(RANK_SCRIPT)
    out = Path(cluster.workdir, "mpiexec-ranks")
    out.mkdir()
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    host2, host3 = cluster.hosts[1].hostname, cluster.hosts[2].hostname
    argv = [
        mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher),
        "-hosts", f"{host2}:2,{host3}:2", "-n", "4", sys.executable, str(script), str(out),
    ]  # fmt: skip
    env = dict(cluster.env, PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")]))  # fmt: skip
    proc = subprocess.run(
        cluster.argv(cluster.hosts[0], argv), capture_output=True, text=True, timeout=180,
        env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], proc.stdout[-3000:]
    assert [r["host"] for r in ranks] == [host2, host2, host3, host3]
    for r in ranks:
        assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2)
        assert (r["local_rank"], r["cross_rank"]) == (r["rank"] % 2, r["rank"] // 2)
        assert r["sum"] == [10.0, 10.0]
