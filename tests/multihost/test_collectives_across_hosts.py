"""run(fn) over 3 hosts x 2 slots: horovod's topology, exact collectives, and who carries what.

One ``run`` of ``layout_and_ops`` (driver_agent.py) on six ranks; every test here asserts on
what the ranks reported. Transport: the local mesh (collective/backends/local_mesh.py) is used
only when every rank of the group is on one host, so across hosts it is off on every rank and
Gloo's TCP connections carry every pair, the two ranks of one host included (over the host's
own address).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)

SIZE, PER_HOST, HOSTS = 6, 2, 3


@pytest.fixture(scope="module")
def ranks(agent) -> list[dict]:
    answer = agent.call("layout", timeout=400)
    assert "error" not in answer, answer.get("tb")
    out = answer["ranks"]
    assert [r["rank"] for r in out] == list(range(SIZE))
    return out


def test_rank_layout_follows_horovod(ranks: list[dict]) -> None:
    host_order = list(dict.fromkeys(r["hostname"] for r in ranks))  # hosts by their first rank
    assert len(host_order) == HOSTS
    for r in ranks:
        assert r["size"] == SIZE
        assert r["local_size"] == PER_HOST
        assert r["cross_size"] == HOSTS
        # Ranks of one host are contiguous; local_rank counts inside the host.
        assert r["local_rank"] == r["rank"] % PER_HOST
        # horovod: cross_rank is the host's place among the hosts holding this local_rank.
        assert r["cross_rank"] == host_order.index(r["hostname"]) == r["rank"] // PER_HOST
        env = r["env"]
        for name, value in [
            ("RANK", r["rank"]),
            ("SIZE", SIZE),
            ("LOCAL_RANK", r["local_rank"]),
            ("LOCAL_SIZE", PER_HOST),
            ("CROSS_RANK", r["cross_rank"]),
            ("CROSS_SIZE", HOSTS),
        ]:
            assert env[f"HOROVOD_{name}"] == env[f"SPARK_ESTIMATORS_{name}"] == str(value)


def test_host_hash_is_the_hostname_of_each_host(ranks: list[dict], cluster) -> None:
    by_address = {h.address: h for h in cluster.hosts}
    for r in ranks:
        (address,) = [a for a in r["addresses"] if a != "127.0.0.1"]
        host = by_address[address]  # the rank ran in a harness host, on its only interface
        assert r["hostname"] == host.hostname
        # DECISIONS.md: host hash = hostname (no salt set here).
        assert r["env"]["SPARK_ESTIMATORS_HOSTNAME"] == host.hostname
    assert {r["hostname"] for r in ranks} == {h.hostname for h in cluster.hosts}
    assert ranks[0]["hosts"] == [r["hostname"] for r in ranks]


def test_collective_results_are_exact_across_hosts(ranks: list[dict]) -> None:
    total = sum(r + 1 for r in range(SIZE))
    for r in ranks:
        me = r["rank"]
        assert r["backend"] == "gloo"
        assert r["allreduce"] == [total * i for i in range(4)]
        assert r["allreduce_big"] == sum(range(SIZE)) / SIZE
        assert r["allgather"] == [[s, 10 * s] for s in range(SIZE)]
        assert r["broadcast"] == [SIZE - 1 + 0.5]
        assert r["alltoall"] == [[100 * s + me] for s in range(SIZE)]


def test_process_sets_spanning_hosts(ranks: list[dict]) -> None:
    even, odd = [0, 2, 4], [1, 3, 5]
    # Each set has one rank on every host.
    assert len({ranks[i]["hostname"] for i in even}) == HOSTS
    for r in ranks:
        members = even if r["rank"] in even else odd
        assert r["set_allreduce"] == [float(sum(m + 1 for m in members))]
        assert r["set_allgather"] == members


def test_gloo_tcp_carries_every_pair_and_the_mesh_is_off(ranks: list[dict]) -> None:
    """Every pair, same host or not, has a TCP connection between the two rank processes."""
    assert not any(r["mesh"] for r in ranks)  # the group spans hosts: no Unix-socket mesh
    ends = [
        {tuple(e) for e in r["listen"]} | {(c[0], c[1]) for c in r["established"]} for r in ranks
    ]
    address = [next(a for a in r["addresses"] if a != "127.0.0.1") for r in ranks]
    for i, r in enumerate(ranks):
        for j in range(SIZE):
            if i == j:
                continue
            links = [c for c in r["established"] if (c[2], c[3]) in ends[j]]
            assert links, f"no TCP connection between rank {i} and rank {j}"
            # Over the peer host's own address (never the loopback), even inside one host.
            assert {c[2] for c in links} == {address[j]}
            assert {c[0] for c in links} == {address[i]}
