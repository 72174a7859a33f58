"""The PMI-1 server: wire protocol with a scripted client, then real MPICH processes against it.

The scripted client speaks exactly what MPICH's ``src/pmi/src/pmi_v1.c`` sends; the process
tests check that ``MPI_Init`` of mpi4py really forms one ``COMM_WORLD`` through the server, and
that a rank killed inside MPI is reported within a second while its peer is stuck in MPI.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from spark_estimators.driver.pmi import PMIServer, format_command, parse_command, process_mapping

pytestmark = pytest.mark.timeout(120)


class Client:
    """A PMI-1 client on a real socket, one request/answer at a time."""

    def __init__(self, server: PMIServer) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=10)
        self.reader = self.sock.makefile("r")

    def send(self, line: str) -> None:
        self.sock.sendall((line + "\n").encode())

    def read(self) -> tuple[str, dict[str, str]]:
        return parse_command(self.reader.readline())

    def ask(self, line: str) -> tuple[str, dict[str, str]]:
        self.send(line)
        return self.read()

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def _join(server: PMIServer, rank: int) -> Client:
    client = Client(server)
    token = server.rank_env(rank)["PMI_ID"]
    assert client.ask(f"cmd=initack pmiid={token}") == ("initack", {"rc": "0"})
    assert [client.read() for _ in range(3)] == [
        ("set", {"size": str(server.size)}),
        ("set", {"rank": str(rank)}),
        ("set", {"debug": "0"}),
    ]
    return client


@pytest.fixture
def failures():
    return queue.SimpleQueue()


@pytest.fixture
def server(failures):
    with PMIServer(
        2, mapping=lambda: process_mapping(["a", "a"]), on_failure=lambda *f: failures.put(f)
    ) as pmi:
        yield pmi


def test_process_mapping_blocks():
    assert process_mapping(["a"]) == "(vector,(0,1,1))"
    assert process_mapping(["a", "a", "b", "b"]) == "(vector,(0,2,2))"
    assert process_mapping(["a", "b", "c"]) == "(vector,(0,3,1))"
    assert process_mapping(["a", "a", "b", "c", "c"]) == "(vector,(0,1,2),(1,1,1),(2,1,2))"
    assert process_mapping(["a", "b", "a"]) == "(vector,(0,2,1),(0,1,1))"


def test_parse_and_format():
    assert parse_command("cmd=get_maxes\n") == ("get_maxes", {})
    assert parse_command(r"cmd=put kvsname=k key=a value=x\ y") == (
        "put",
        {"kvsname": "k", "key": "a", "value": r"x\ y"},
    )
    assert format_command("maxes", rc=0, keylen_max=64) == b"cmd=maxes rc=0 keylen_max=64\n"
    with pytest.raises(ValueError, match="not a PMI-1 command"):
        parse_command("mcmd=spawn")


def test_rank_env_tokens_are_random_distinct_and_not_the_rank():
    with PMIServer(8) as pmi:
        envs = [pmi.rank_env(r) for r in range(8)]
    tokens = {int(e["PMI_ID"]) for e in envs}
    assert len(tokens) == 8 and all(0 < t < 2**31 for t in tokens)
    assert tokens != set(range(8))
    assert {e["PMI_PORT"] for e in envs} == {f"127.0.0.1:{pmi.port}"}
    assert [e["PMI_RANK"] for e in envs] == [str(r) for r in range(8)]


def test_full_init_sequence_kvs_and_barrier(server, failures):
    c0, c1 = _join(server, 0), _join(server, 1)
    assert c0.ask("cmd=init pmi_version=1 pmi_subversion=1") == (
        "response_to_init",
        {"rc": "0", "pmi_version": "1", "pmi_subversion": "1"},
    )
    cmd, maxes = c0.ask("cmd=get_maxes")
    assert cmd == "maxes" and maxes == {
        "rc": "0", "kvsname_max": "256", "keylen_max": "64", "vallen_max": "1024",
    }  # fmt: skip
    assert c0.ask("cmd=get_appnum") == ("appnum", {"rc": "0", "appnum": "0"})
    assert c0.ask("cmd=get_universe_size") == ("universe_size", {"rc": "0", "size": "2"})
    cmd, got = c1.ask("cmd=get_my_kvsname")
    kvs = got["kvsname"]
    assert cmd == "my_kvsname" and kvs == server.kvsname
    assert c0.ask(f"cmd=put kvsname={kvs} key=card-0 value=tcp://x:1$y") == (
        "put_result",
        {"rc": "0"},
    )
    # barrier_out only once both ranks are in: a request rank 0 sends after its barrier_in is
    # answered first (the server handles one connection's lines in order)
    c0.send("cmd=barrier_in")
    assert c0.ask("cmd=get_appnum")[0] == "appnum"
    assert c1.ask("cmd=barrier_in") == ("barrier_out", {"rc": "0"})
    assert c0.read() == ("barrier_out", {"rc": "0"})
    assert c1.ask(f"cmd=get kvsname={kvs} key=card-0") == (
        "get_result",
        {"rc": "0", "found": "TRUE", "value": "tcp://x:1$y"},
    )
    assert c1.ask(f"cmd=get kvsname={kvs} key=PMI_process_mapping")[1]["value"] == (
        "(vector,(0,1,2))"
    )
    assert c1.ask(f"cmd=get kvsname={kvs} key=nope")[1]["rc"] == "-1"
    assert c1.ask("cmd=lookup_name service=x") == (
        "lookup_result",
        {"rc": "-1", "msg": "lookup_name_not_supported"},
    )
    for rank, c in enumerate((c0, c1)):
        assert c.ask("cmd=finalize") == ("finalize_ack", {"rc": "0"})
        c.close()
        assert rank in server.finalized
    assert failures.empty()


def test_unknown_or_reused_token_is_refused(server):
    stranger = Client(server)
    assert stranger.ask("cmd=initack pmiid=12345")[1]["rc"] == "-1"
    assert stranger.reader.readline() == ""  # closed by the server
    first = _join(server, 0)
    again = Client(server)
    token = server.rank_env(0)["PMI_ID"]
    assert again.ask(f"cmd=initack pmiid={token}")[1]["rc"] == "-1"
    first.close()
    again.close()


def test_drop_before_finalize_and_abort_are_reported(server, failures):
    c0, c1 = _join(server, 0), _join(server, 1)
    started = time.monotonic()
    c1.close()
    rank, message = failures.get(timeout=5)
    assert rank == 1 and "before MPI_Finalize" in message
    assert time.monotonic() - started < 1.0
    c0.send("cmd=abort exitcode=7 message=application called MPI_Abort(comm, 7)")
    assert failures.get(timeout=5) == (
        0,
        "called MPI_Abort (exit code 7): application called MPI_Abort(comm, 7)",
    )
    c0.close()
    assert failures.empty() or failures.get(timeout=1) is None  # no second report for rank 0


# -- real MPICH processes --------------------------------------------------------------------
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")

RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    value = np.array([comm.Get_rank() + 1.0])
    comm.Allreduce(MPI.IN_PLACE, value)
    print(comm.Get_rank(), comm.Get_size(), value[0], flush=True)
    if sys.argv[1] == "kill" and comm.Get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "kill":
        comm.Bcast(value, root=1)  # waits forever for the dead rank
    """
)


def _start_ranks(pmi: PMIServer, mode: str) -> list[subprocess.Popen[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_")}
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, mode],
            env={**env, **pmi.rank_env(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(pmi.size)
    ]


@needs_mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("nodes", [["h", "h"], ["h1", "h2"]])
def test_mpich_ranks_form_one_comm_world(failures, nodes):
    # one node: shared memory; two nodes: the business cards travel through put/get
    with PMIServer(2, mapping=process_mapping(nodes), on_failure=lambda *f: failures.put(f)) as p:
        procs = _start_ranks(p, "ok")
        outputs = [proc.communicate(timeout=90) for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], outputs
        assert sorted(out.strip() for out, _ in outputs) == ["0 2 3.0", "1 2 3.0"]
        assert p.finalized == {0, 1}  # mpi4py finalizes at exit
    assert failures.empty()


@needs_mpi
@pytest.mark.multiprocess
def test_rank_killed_inside_mpi_is_reported_while_its_peer_hangs(failures):
    reported = threading.Event()

    def on_failure(rank: int, message: str) -> None:
        failures.put((rank, message, time.monotonic()))
        reported.set()

    with PMIServer(2, mapping=process_mapping(["h", "h"]), on_failure=on_failure) as pmi:
        procs = _start_ranks(pmi, "kill")
        try:
            assert procs[1].wait(timeout=90) == -9
            died = time.monotonic()
            assert reported.wait(timeout=5)
            rank, message, when = failures.get()
            assert rank == 1 and "before MPI_Finalize" in message
            assert when - died < 1.0
            assert procs[0].poll() is None  # rank 0 is stuck in MPI: the launcher must kill it
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                proc.communicate(timeout=30)
    # killing the survivor (what a launcher does) is reported too; the driver ignores reports
    # that arrive after it aborted the job
    later = []
    while not failures.empty():
        later.append(failures.get()[0])
    assert later in ([], [0])


# -- the driver side of spark_estimators.run(..., backend="mpi") ------------------------------
def test_serve_mpi_job_sets_rank_env_and_fails_the_job_on_a_lost_rank():
    from spark_estimators.driver.frames import new_secret
    from spark_estimators.driver.pmi import serve_mpi_job
    from spark_estimators.driver.rpc import RpcClient
    from spark_estimators.driver.service import DriverService
    from spark_estimators.errors import RemoteError

    secret = new_secret()
    svc = DriverService(2, secret, b"payload", env={"PMI_PORT": "user:1", "MY": "x"})
    pmi = serve_mpi_job(svc, "127.0.0.1")
    replies: dict[int, dict] = {}
    clients = [RpcClient(svc.address, secret, timeout=30) for _ in range(2)]  # the "tasks"

    def register(index: int, host_hash: str) -> None:
        replies[index] = clients[index].call(
            "register",
            {"index": index, "host": "h", "host_hash": host_hash, "pid": index,
             "address": "127.0.0.1", "port": 1, "gpus": (), "attempt": 0},
        )  # fmt: skip

    try:
        threads = [threading.Thread(target=register, args=(i, f"node{i}")) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for index, reply in replies.items():
            rank = reply["settings"].rank
            assert reply["env"] == {"MY": "x", **pmi.rank_env(rank)}  # ours win over env=
            assert "PMI_FD" in reply["unset"]
        c0, c1 = _join(pmi, 0), _join(pmi, 1)
        kvs = pmi.kvsname
        assert c0.ask(f"cmd=get kvsname={kvs} key=PMI_process_mapping")[1]["value"] == (
            "(vector,(0,2,1))"  # two host hashes, one rank each
        )
        c1.close()  # rank 1 dies without finalizing: the job aborts at once
        assert svc.wait(lambda s: s.abort_reason is not None, timeout=5)
        assert "before MPI_Finalize" in svc.state.failures[1].message
        # the rank's own report (exit signal, stderr tail) replaces the provisional one
        svc.record_failure(RemoteError(rank=1, host="h", message="killed by signal SIGKILL"))
        assert svc.state.failures[1].message == "killed by signal SIGKILL"
        svc.record_failure(RemoteError(rank=1, host="h", message="a later echo"))
        assert svc.state.failures[1].message == "killed by signal SIGKILL"
        c0.close()  # killed by the launcher after the abort: not a failure of its own
        svc.report_lost_rank(0, "closed")
        assert sorted(svc.state.failures) == [1]
    finally:
        pmi.close()
        svc.close()
        for client in clients:
            client.close()
