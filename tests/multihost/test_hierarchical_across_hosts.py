"""Hierarchical allreduce/allgather on 3 hosts x 2 ranks: the layout run, switches on.

A driver of its own (``netns.DriverAgent`` with ``spark.executorEnv.HOROVOD_HIERARCHICAL_*=1``,
so every rank process inherits the switches from its executor) runs the harness's generic
``layout`` scenario: six ranks, two per host, each reporting its topology, its environment and
the results of allreduce (small and 100k elements, above the inline room, so the backend's
hierarchical path), allgather, broadcast, alltoall and process sets. The session's own driver
holds every executor core, so this file (last by name) gives it back first.

Cost: a second Spark application start (~30-60 s on the 2-core machine) plus one run.
"""

from __future__ import annotations

import netns
import pytest

pytestmark = pytest.mark.timeout(900)

SIZE, PER_HOST, HOSTS = 6, 2, 3
SWITCHES = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}


@pytest.fixture  # one test; whole_cluster is per test
def ranks(whole_cluster, agent) -> list[dict]:
    # whole_cluster: the Workers an earlier fault test killed are back, three executors again.
    agent.close()  # frees the executors' cores for this application (idempotent at teardown)
    conf = {f"spark.executorEnv.{k}": v for k, v in SWITCHES.items()}
    driver = netns.DriverAgent(whole_cluster, key="driver-hierarchical", conf=conf)
    try:
        answer = driver.call("layout", timeout=600)
    finally:
        driver.close()
    assert "error" not in answer, answer.get("tb")
    return answer["ranks"]


def test_hierarchical_results_are_exact_across_hosts(ranks: list[dict]) -> None:
    assert [r["rank"] for r in ranks] == list(range(SIZE))
    assert len({r["hostname"] for r in ranks}) == HOSTS
    total = sum(r + 1 for r in range(SIZE))
    for r in ranks:
        me = r["rank"]
        # The switches reached every rank, on hosts of two ranks each: the hierarchical layout.
        assert {k: r["env"].get(k) for k in SWITCHES} == SWITCHES
        assert (r["local_size"], r["cross_size"]) == (PER_HOST, HOSTS)
        assert not r["mesh"]
        assert r["allreduce"] == [total * i for i in range(4)]
        assert r["allreduce_big"] == sum(range(SIZE)) / SIZE  # exact: integer partial sums
        assert r["allgather"] == [[s, 10 * s] for s in range(SIZE)]
        assert r["broadcast"] == [SIZE - 1 + 0.5]
        assert r["alltoall"] == [[100 * s + me] for s in range(SIZE)]
        members = [0, 2, 4] if me % 2 == 0 else [1, 3, 5]
        assert r["set_allreduce"] == [float(sum(m + 1 for m in members))]
        assert r["set_allgather"] == members
        assert r["hosts"] == [x["hostname"] for x in ranks]
