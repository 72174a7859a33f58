"""Issue 42: a task that cannot connect to the driver service says so, naming its host."""

from __future__ import annotations

import pickle
import socket
import time

import pytest

from spark_estimators.errors import DriverUnreachableError, RendezvousTimeoutError
from spark_estimators.task.spark_task import TaskConfig, connect_driver


def test_a_refused_connect_names_the_host_and_the_driver_address(free_port) -> None:
    port = free_port()  # nothing listens there
    config = TaskConfig(("127.0.0.1", port), b"s" * 32, "job", start_timeout=20)
    started = time.monotonic()
    with pytest.raises(DriverUnreachableError) as info:
        connect_driver(config, 3)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert f"task 3 on host {socket.gethostname()!r}" in message
    assert f"cannot reach the driver service at 127.0.0.1:{port}" in message
    assert "driver_host=" in message


def test_the_error_is_a_rendezvous_timeout_and_survives_pickling() -> None:
    exc = DriverUnreachableError("task 1 on host 'h' ...", registered=[0], expected=2)
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, RendezvousTimeoutError) and isinstance(again, ConnectionError)
    assert (str(again), again.registered, again.expected) == (str(exc), [0], 2)
