"""The rendezvous port is held by whoever advertises it, from the moment it is advertised.

Before, the port was probed (bind port 0, read, close) and rank 0's store bound it seconds later;
in between another job's probe or an outgoing connection could take it (two concurrent ``run()``
jobs then failed in gloo's join with "Connection reset by peer"). These tests bind the
advertised port the way any other process would and expect EADDRINUSE while the job still
needs the port; with the probe-and-close port they bound it fine.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import threading

import pytest

from spark_estimators._base.ports import reserve_port, reserved_port
from spark_estimators.launch import run_local

pytestmark = [pytest.mark.timeout(120)]


def _taken_by_someone(port: int) -> bool:
    """True when a plain bind of ``port`` (another job's probe, any server) fails: EADDRINUSE.

    Only a listener that sets ``SO_REUSEADDR`` itself, as torch's store does, may share the
    port with a reservation; nobody is told the port but the job's own ranks.
    """
    for host in ("", "127.0.0.1"):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        finally:
            probe.close()
        return False
    return True


def test_a_reserved_port_refuses_other_binds_until_closed():
    with reserve_port() as held:
        port = reserved_port(held)
        assert port > 0
        assert _taken_by_someone(port)
    assert not _taken_by_someone(port)  # released: the port is ordinary again


@pytest.mark.parametrize("use_libuv", [True, False])
def test_torch_store_binds_a_reserved_port(use_libuv):
    dist = pytest.importorskip("torch.distributed")
    with reserve_port() as held:
        port = reserved_port(held)
        timeout = datetime.timedelta(seconds=30)
        master = dist.TCPStore(
            "127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False,
            use_libuv=use_libuv,
        )  # fmt: skip
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
        assert master.port == port
        master.set("from-master", "7")
        assert client.get("from-master") == b"7"
        del client, master


def _advertised_port_state() -> dict:
    """Run in each rank before any store exists: is the advertised MASTER_PORT held?"""
    import os

    port = int(os.environ["MASTER_PORT"])
    return {"rank": int(os.environ["RANK"]), "port": port, "held": _taken_by_someone(port)}


@pytest.mark.multiprocess
def test_local_launcher_holds_the_port_it_advertises():
    out = run_local(_advertised_port_state, num_proc=2, backend="gloo")
    assert [r["rank"] for r in out] == [0, 1]
    assert len({r["port"] for r in out}) == 1
    assert [r["held"] for r in out] == [True, True]


@pytest.mark.multiprocess
def test_local_launcher_allreduce_on_its_held_port():
    # The held port is the one rank 0's store binds: a real gloo job on it works.
    out = run_local(_gloo_sum, num_proc=2, backend="gloo")
    assert out == [3.0, 3.0]


def _gloo_sum() -> float:
    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    try:
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
        return float(total[0])
    finally:
        hvd.shutdown()


def test_elastic_round_rank_0_holds_the_advertised_port():
    """Each elastic round's rank 0 worker holds the port the driver hands every member."""
    import pickle

    from spark_estimators.driver.rpc import RpcClient
    from spark_estimators.elastic.service import ElasticDriverService, ElasticPolicy
    from spark_estimators.elastic.worker import _Rendezvous

    policy = ElasticPolicy(
        num_proc=2, min_num_proc=2, max_num_proc=2, start_timeout=30, elastic_timeout=30,
        reset_limit=None, rejoin_wait=0.0,
    )  # fmt: skip
    secret = os.urandom(32)
    svc = ElasticDriverService(policy, secret, pickle.dumps(None))
    clients = [RpcClient(svc.address, secret) for _ in range(2)]
    links: list[_Rendezvous] = []
    try:
        for i, client in enumerate(clients):
            joined = client.call(
                "join", {"index": i, "attempt": 0, "host": "h", "host_hash": "h",
                         "address": "127.0.0.1"},
            )  # fmt: skip
            links.append(_Rendezvous(client, joined["worker_id"], "gloo"))
        saved = dict(os.environ)
        answers: dict[int, bool] = {}
        try:
            threads = [
                threading.Thread(target=lambda i=i: answers.__setitem__(i, links[i]()))
                for i in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert answers == {0: True, 1: True}
        settings = {link.rank: svc.state.settings[link.worker_id] for link in links}
        assert sorted(settings) == [0, 1]
        port = settings[0].master_port
        assert settings[1].master_port == port
        assert _taken_by_someone(port)
        rank0 = next(link for link in links if link.rank == 0)
        rank1 = next(link for link in links if link.rank == 1)
        assert rank0._reservation is not None and reserved_port(rank0._reservation) == port
        assert rank1._reservation is not None and rank1._reservation.fileno() == -1  # let go
    finally:
        for link in links:
            if link._reservation is not None:
                link._reservation.close()
        for client in clients:
            client.close()
        svc.server.close()
