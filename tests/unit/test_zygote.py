"""The zygote's fork protocol (spark_estimators/task/zygote.py), with real processes.

A small zygote runs ``serve`` with a ``become_rank`` that reports what a forked child sees
(its pid, process group, parent, a numpy draw) and exits with the code it reads on stdin (a
negative code: wait for a second line with the code, as a rank that runs on). It exits through
``exit_now``, as a real rank does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from spark_estimators.task import zygote

pytestmark = pytest.mark.timeout(120)

ZYGOTE = textwrap.dedent(
    """
    import json, os, socket, sys
    import numpy as np
    from spark_estimators._base.child import exit_now
    from spark_estimators.task import zygote

    def become_rank():
        code = int(sys.stdin.readline())
        print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
                          "draw": float(np.random.random())}), flush=True)
        if code < 0:
            code = int(sys.stdin.readline())  # wait for the code (or to be killed)
        exit_now(code)

    key = bytes.fromhex(os.environ.pop("TEST_ZYGOTE_KEY"))
    executor = int(sys.argv[3]) if len(sys.argv) > 3 else None
    zygote.serve(socket.socket(fileno=int(sys.argv[1])), float(sys.argv[2]), become_rank, executor,
                 key=key)
    """
)
KEY = os.urandom(zygote.KEY_BYTES)


def _spawn(address: str, *extra: str) -> subprocess.Popen:
    listener = zygote.listen(address)
    assert listener is not None
    with listener:
        return subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(listener.fileno()), "60", *extra],
            pass_fds=(listener.fileno(),),
            start_new_session=True,
            env={**os.environ, "TEST_ZYGOTE_KEY": KEY.hex()},
        )


@pytest.fixture
def small_zygote():
    """A running zygote and its address; killed at the end."""
    address = f"\0spark-estimators-test-zygote-{uuid.uuid4().hex}"
    proc = _spawn(address)
    yield proc, address
    proc.kill()
    proc.wait()


def _start(address: str, code: int) -> tuple[zygote.ForkedRank, dict]:
    rank = zygote.request_fork(address, KEY, timeout=60)
    assert rank.stdin is not None and rank.stdout is not None
    rank.stdin.write(f"{code}\n".encode())
    rank.stdin.flush()
    return rank, json.loads(rank.stdout.readline())


def test_each_child_is_its_own_group_with_its_own_seed_and_its_exit_code(small_zygote):
    proc, address = small_zygote
    first, seen1 = _start(address, 3)
    second, seen2 = _start(address, 0)
    assert (seen1["pid"], seen2["pid"]) == (first.pid, second.pid)
    assert first.pid != second.pid
    assert seen1["pgid"] == seen1["pid"] and seen2["pgid"] == seen2["pid"]  # own groups
    assert seen1["ppid"] == seen2["ppid"] == proc.pid  # forked by the zygote
    assert seen1["draw"] != seen2["draw"]  # numpy reseeded in each child
    assert first.wait(timeout=60) == 3
    assert second.wait(timeout=60) == 0
    assert first.poll() == 3  # read once, kept


def test_a_running_child_polls_none_times_out_and_reads_its_kill(small_zygote):
    _proc, address = small_zygote
    rank, _ = _start(address, -1)  # waits on stdin
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.05)
    rank.kill()
    assert rank.wait(timeout=60) == -signal.SIGKILL


def test_an_address_has_one_zygote_and_the_zygote_leaves_with_its_executor():
    address = f"\0spark-estimators-test-zygote-{uuid.uuid4().hex}"
    executor = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    proc = _spawn(address, str(executor.pid))
    try:
        assert zygote.listen(address) is None  # held: a second worker starts no second zygote
        rank, _ = _start(address, 0)
        assert rank.wait(timeout=60) == 0
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)  # serving while the executor lives
        assert executor.stdin is not None
        executor.stdin.close()  # the executor ends ...
        executor.wait()
        assert proc.wait(timeout=60) == 0  # ... and so does its zygote
        with pytest.raises(zygote.ZygoteGone):
            zygote.request_fork(address, KEY, timeout=5)
    finally:
        for p in (proc, executor):
            p.kill()
            p.wait()


def test_a_peer_of_another_user_is_not_served_even_with_the_key(small_zygote):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    proc, address = small_zygote
    before = _children(proc.pid)
    code = textwrap.dedent(
        f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        r, w = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect({address!r})
            try:
                socket.send_fds(s, [b"F" + {KEY!r}], [r, w, w, w])
                print("served" if s.recv(8) else "refused")
            except ConnectionResetError:  # closed unread
                print("refused")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr
    assert _children(proc.pid) == before
    rank, _ = _start(address, 0)  # the zygote still serves its own user
    assert rank.wait(timeout=60) == 0


def test_a_dead_zygote_is_reported_not_waited_for(small_zygote):
    proc, address = small_zygote
    proc.kill()
    proc.wait()
    with pytest.raises(zygote.ZygoteGone):
        zygote.request_fork(address, KEY, timeout=5)


def test_a_request_without_the_key_forks_nothing(small_zygote):
    proc, address = small_zygote
    before = _children(proc.pid)
    with pytest.raises(zygote.ZygoteGone):
        zygote.request_fork(address, os.urandom(zygote.KEY_BYTES), timeout=10)
    assert _children(proc.pid) == before  # dropped before any fork
    rank, _ = _start(address, 0)  # the zygote still serves the key's holder
    assert rank.wait(timeout=60) == 0


def _children(pid: int) -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process(pid).children()}


def test_a_rank_outlives_its_zygote_and_reports_its_own_exit_code(small_zygote):
    """Killing the zygote in the middle of a fit must not fail the ranks it forked."""
    proc, address = small_zygote
    rank, _ = _start(address, -1)
    os.killpg(proc.pid, signal.SIGKILL)  # the zygote only: the rank leads its own group
    proc.wait()
    assert rank.poll() is None  # still running
    assert rank.stdin is not None
    rank.stdin.write(b"0\n")
    rank.stdin.flush()
    assert rank.wait(timeout=60) == 0  # its own word: healthy (was 1, "failed")


def test_a_child_orphaned_by_its_zygote_is_waited_for(small_zygote):
    proc, address = small_zygote
    rank, seen = _start(address, -1)
    os.killpg(proc.pid, signal.SIGKILL)  # the zygote only: the rank leads its own group
    proc.wait()
    assert rank.poll() is None  # still running, though its status pipe has lost its writer
    rank.kill()
    assert rank.wait(timeout=60) == 1  # no code without the zygote: "ended without a result"


def test_a_wait_and_a_poll_from_two_threads_see_the_same_end(small_zygote):
    """The task's main thread waits while its abort watcher polls (task/spark_task.py)."""
    import threading

    _proc, address = small_zygote
    rank, _ = _start(address, -1)
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: waited.append(rank.wait()))
    waiter.start()
    assert rank.poll() is None
    rank.kill()
    waiter.join(timeout=60)
    assert waited == [-signal.SIGKILL]
    assert rank.poll() == -signal.SIGKILL
