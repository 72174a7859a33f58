"""Issue 27 item 8: the driver service survives ``accept()`` failing with EMFILE.

A real server in a subprocess with a low RLIMIT_NOFILE fills its descriptor table; a client
from this process connects (the kernel queues it), the server's accept() fails with EMFILE, then
the subprocess frees its descriptors and the waiting client must be served. Before the fix the
accept loop returned on the first error: the port stayed open and was never served again.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from spark_estimators.driver.frames import HELLO_BYTES, MAGIC, _recv_exact
from spark_estimators.driver.rpc import RpcClient

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SECRET = b"e" * 32

_SERVER = textwrap.dedent(
    r"""
    import logging, os, resource, sys, threading
    from spark_estimators.driver.rpc import RpcServer

    failed = threading.Event()
    warnings = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
                if "cannot accept" in record.getMessage():
                    failed.set()

    log = logging.getLogger("spark_estimators.driver.rpc")
    log.addHandler(Seen())
    log.setLevel(logging.DEBUG)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    srv = RpcServer(sys.argv[1].encode(), lambda kind, data, conn: ("echo", data))
    fill = []
    try:
        while True:
            fill.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(srv.address[1], flush=True)
    sys.stdin.readline()             # the client has connected
    seen = failed.wait(30)           # accept() failed with EMFILE (before the fix: never)
    retries_before_free = sum(srv.accept_errors.values())
    for fd in fill:
        os.close(fd)
    print("freed", seen, retries_before_free, flush=True)
    sys.stdin.readline()             # the client got its reply
    print("warnings", sum("cannot accept" in w for w in warnings), dict(srv.accept_errors),
          flush=True)
    srv.close()
    """
)


def test_server_serves_again_after_running_out_of_descriptors():
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        # Connect (queued by the kernel in the listen backlog), then let the server go on.
        pending = socket.create_connection(("127.0.0.1", port), timeout=30)
        proc.stdin.write("connected\n")
        proc.stdin.flush()
        freed = proc.stdout.readline().split()
        assert freed[:2] == ["freed", "True"], freed  # accept() did fail with EMFILE
        assert int(freed[2]) >= 1
        # The queued connection is now accepted: it gets the server's hello.
        assert _recv_exact(pending, HELLO_BYTES)[:4] == MAGIC
        pending.close()
        with RpcClient(("127.0.0.1", port), SECRET, timeout=30) as client:
            assert client.call("ping", {"n": 7}) == ("echo", {"n": 7})
        proc.stdin.write("done\n")
        proc.stdin.flush()
        summary = proc.stdout.readline()
        assert summary.startswith("warnings 1 "), summary  # logged once, not once per retry
        assert "EMFILE" in summary
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
