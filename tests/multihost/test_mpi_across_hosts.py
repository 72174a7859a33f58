"""run(fn, backend="mpi") over 3 hosts x 2 slots: one MPI_COMM_WORLD across the hosts.

The ranks are started by their Spark tasks and wired by the driver's PMI-1 server
(docs/mpi.md), not by ``mpiexec``: MPICH's own data path then carries the traffic between the
hosts' addresses, and its process mapping (from the host hashes) puts two ranks on each node.
"""

from __future__ import annotations

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
