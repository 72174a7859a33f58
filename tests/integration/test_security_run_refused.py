"""Issue 27 item 11: a run() that times out while its driver service refuses connections says so.

A real run() on the shared local[2] session; right after its driver service starts, this
process holds the per-address handshake slots of 127.0.0.1 (where the tasks connect from), so
the tasks cannot register. Before the fix the RendezvousTimeoutError blamed a busy cluster or
driver_host.
"""

from __future__ import annotations

import socket
import threading

import pytest

import spark_estimators
from spark_estimators import runner
from spark_estimators.driver.frames import HELLO_BYTES, _recv_exact
from spark_estimators.driver.service import DriverService
from spark_estimators.errors import RendezvousTimeoutError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


def _never_called():
    return "unreachable"


def test_timeout_names_the_refused_connections(spark, monkeypatch):
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED_PER_HOST", "2")
    monkeypatch.setenv("SPARK_ESTIMATORS_RPC_AUTH_TIMEOUT", "60")
    held: list[socket.socket] = []
    refused = threading.Event()

    class Squatted(DriverService):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for _ in range(2):  # idle handshakes from the tasks' own address
                sock = socket.create_connection(self.address, timeout=10)
                _recv_exact(sock, HELLO_BYTES)  # accepted: the slot is taken
                held.append(sock)
            note = self.server.refusals.note

            def noted(*args):
                note(*args)
                refused.set()

            self.server.refusals.note = noted

        def wait(self, predicate, timeout):
            # The start_timeout runs out only after a task was turned away (Spark may take
            # longer than start_timeout to start a Python worker on a loaded machine).
            if timeout is not None:
                refused.wait(120)
            return super().wait(predicate, timeout)

    monkeypatch.setattr(runner, "DriverService", Squatted)
    try:
        with pytest.raises(RendezvousTimeoutError) as info:
            spark_estimators.run(_never_called, num_proc=2, spark=spark, start_timeout=3)
    finally:
        for sock in held:
            sock.close()
    message = str(info.value)
    assert "only 0 of 2 Spark tasks registered" in message
    assert "refused" in message and "per-address cap" in message, message
    assert "driver_host=" not in message  # not the hint for an unreachable driver
