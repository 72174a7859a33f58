"""The zygote's fork protocol (spark_estimators/task/zygote.py), with real processes.

A small zygote runs ``serve`` with a ``become_rank`` that reports what a forked child sees
(its pid, process group, parent, a numpy draw) and exits with the code it reads on stdin.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from spark_estimators.task import zygote

pytestmark = pytest.mark.timeout(120)

ZYGOTE = textwrap.dedent(
    """
    import json, os, socket, sys
    import numpy as np
    from spark_estimators.task import zygote

    def become_rank():
        code = int(sys.stdin.readline())
        print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
                          "draw": float(np.random.random())}), flush=True)
        if code < 0:
            sys.stdin.readline()  # wait to be killed
        os._exit(code)

    zygote.serve(socket.socket(fileno=int(sys.argv[1])), float(sys.argv[2]), become_rank)
    """
)


@pytest.fixture
def small_zygote():
    """A running zygote and our end of its socket; killed at the end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(theirs.fileno()), "60"],
        pass_fds=(theirs.fileno(),),
        start_new_session=True,
    )
    theirs.close()
    yield proc, ours
    ours.close()
    proc.kill()
    proc.wait()


def _start(sock: socket.socket, code: int) -> tuple[zygote.ForkedRank, dict]:
    rank = zygote.request_fork(sock, timeout=60)
    assert rank.stdin is not None and rank.stdout is not None
    rank.stdin.write(f"{code}\n".encode())
    rank.stdin.flush()
    return rank, json.loads(rank.stdout.readline())


def test_each_child_is_its_own_group_with_its_own_seed_and_its_exit_code(small_zygote):
    proc, sock = small_zygote
    first, seen1 = _start(sock, 3)
    second, seen2 = _start(sock, 0)
    assert (seen1["pid"], seen2["pid"]) == (first.pid, second.pid)
    assert first.pid != second.pid
    assert seen1["pgid"] == seen1["pid"] and seen2["pgid"] == seen2["pid"]  # own groups
    assert seen1["ppid"] == seen2["ppid"] == proc.pid  # forked by the zygote
    assert seen1["draw"] != seen2["draw"]  # numpy reseeded in each child
    assert first.wait(timeout=60) == 3
    assert second.wait(timeout=60) == 0
    assert first.poll() == 3  # read once, kept


def test_a_running_child_polls_none_times_out_and_reads_its_kill(small_zygote):
    _proc, sock = small_zygote
    rank, _ = _start(sock, -1)  # waits on stdin
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.05)
    rank.kill()
    assert rank.wait(timeout=60) == -signal.SIGKILL


def test_the_zygote_leaves_when_its_worker_does_and_no_child_is_left(small_zygote):
    proc, sock = small_zygote
    rank, _ = _start(sock, -1)
    sock.shutdown(socket.SHUT_RDWR)  # the worker is gone ...
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)  # ... but a rank still runs: the zygote waits to reap it
    assert rank.stdin is not None
    rank.stdin.close()  # EOF: the rank's readline returns, it exits with int('') -> error
    assert rank.wait(timeout=60) != 0
    assert proc.wait(timeout=60) == 0


def test_a_dead_zygote_is_reported_not_waited_for(small_zygote):
    proc, sock = small_zygote
    proc.kill()
    proc.wait()
    with pytest.raises(zygote.ZygoteGone):
        zygote.request_fork(sock, timeout=5)


def test_a_child_orphaned_by_its_zygote_is_waited_for(small_zygote):
    proc, sock = small_zygote
    rank, seen = _start(sock, -1)
    os.killpg(proc.pid, signal.SIGKILL)  # the zygote only: the rank leads its own group
    proc.wait()
    assert rank.poll() is None  # still running, though its status pipe has lost its writer
    rank.kill()
    assert rank.wait(timeout=60) == 1  # no code without the zygote: "ended without a result"
