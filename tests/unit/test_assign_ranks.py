from spark_estimators.driver.service import Registration, assign_ranks


def reg(index, host):
    return Registration(
        index=index,
        host=host,
        host_hash=host,
        pid=100 + index,
        address=f"10.0.0.{index}",
        port=5000 + index,
    )


def test_ranks_contiguous_per_host_and_cross_ranks():
    # Tasks interleave across two hosts; ranks must group by host, in task order.
    regs = [reg(0, "a"), reg(1, "b"), reg(2, "a"), reg(3, "b"), reg(4, "a")]
    out = assign_ranks(regs)
    assert [out[i].rank for i in range(5)] == [0, 3, 1, 4, 2]
    assert [out[i].local_rank for i in range(5)] == [0, 0, 1, 1, 2]
    assert [out[i].local_size for i in range(5)] == [3, 2, 3, 2, 3]
    assert [out[i].cross_rank for i in range(5)] == [0, 1, 0, 1, 0]
    # local_rank 2 exists only on host a: cross_size 1 there.
    assert [out[i].cross_size for i in range(5)] == [2, 2, 2, 2, 1]
    assert {s.master_addr for s in out.values()} == {"10.0.0.0"}
    assert {s.master_port for s in out.values()} == {5000}
    assert sorted(s.rank for s in out.values()) == list(range(5))


def test_single_host():
    out = assign_ranks([reg(1, "h"), reg(0, "h")])
    assert out[0].rank == 0 and out[1].rank == 1
    assert out[1].local_rank == 1 and out[1].cross_size == 1 and out[1].cross_rank == 0
