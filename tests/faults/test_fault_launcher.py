"""Faults of the fixed-size launcher ``run()`` on real Spark, each with its time bound.

The bound of every case is DECISIONS' promise: the launcher stops all ranks within 10 s of any
rank failing (measured from the moment the fault is injected, see ``faultlib``). Plain raising
and SIGKILL *before* any collective are covered by tests/integration/test_run.py; here the
faults hit a rank in the middle of collective work, the driver service and the executor.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from faultlib import fault_time, seconds_since_fault

import spark_estimators
from spark_estimators import envvars as ev
from spark_estimators.errors import TrainingFailedError

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

STOP_BOUND_S = 10.0  # DECISIONS: all ranks stopped within 10 s of a failure
START_S = 180  # rank start-up on a loaded 2-core machine; bounds count from the fault instead
# The survivor would wait this long in its collective if the launcher did not stop it.
LONG_COLLECTIVE_TIMEOUT = {ev.COLLECTIVE_TIMEOUT: "300"}
KILLED_RANK_RACE = (
    "launcher race: the survivor's CollectiveError reached the driver before the killed rank's "
    "SIGKILL report (its task reports only after proc.wait() and flushing output), so the "
    "error blamed the survivor; see docs/reliability.md"
)


def _stamp(clock: str) -> None:
    with open(clock, "w") as f:
        f.write(repr(time.time()))


def _raise_mid_training(clock: str) -> int:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    for step in range(10_000):
        t = hvd.allreduce(torch.ones(1024), name=f"step{step}")
        if step == 5 and hvd.rank() == 1:
            _stamp(clock)
            raise ArithmeticError(f"rank one gives up at step {step}")
        assert float(t[0]) == 1.0
    return hvd.rank()


def test_rank_raising_mid_training_stops_the_job(spark, clock):
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(
            _raise_mid_training, args=(str(clock),), num_proc=2, spark=spark,
            env=LONG_COLLECTIVE_TIMEOUT, start_timeout=START_S,
        )  # fmt: skip
    waited = seconds_since_fault(clock)
    assert waited < STOP_BOUND_S, f"run() returned {waited:.1f}s after the fault"
    err = info.value
    assert 1 in err.failed_ranks
    assert "rank one gives up at step 5" in err.worker_failures[1].traceback
    assert "_raise_mid_training" in err.worker_failures[1].traceback


BIG = 8 * 1024 * 1024  # 32 MiB of float32: rank 1 dies while the transfer is under way


def _sigkill_mid_allreduce(clock: str) -> int:
    import os
    import signal

    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    hvd.barrier()
    tensor = torch.ones(BIG)
    if hvd.rank() == 1:
        hvd.allreduce_async_(tensor, op=hvd.Sum, name="big")
        _stamp(clock)
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce_(tensor, op=hvd.Sum, name="big")
    return hvd.rank()


def test_rank_sigkilled_mid_allreduce_stops_the_job(spark, clock):
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(
            _sigkill_mid_allreduce, args=(str(clock),), num_proc=2, spark=spark,
            env=LONG_COLLECTIVE_TIMEOUT, start_timeout=START_S,
        )  # fmt: skip
    waited = seconds_since_fault(clock)
    assert waited < STOP_BOUND_S, f"run() returned {waited:.1f}s after the fault"
    # The survivor may also report (its allreduce broke); it must never report success.
    assert info.value.failed_ranks and set(info.value.failed_ranks) <= {0, 1}
    # The autouse fixture asserts that no rank process is left running.
    if 1 not in info.value.failed_ranks:
        pytest.xfail(KILLED_RANK_RACE)
    killed = info.value.worker_failures[1]
    assert "SIGKILL" in killed.message and killed.exit_code == -9


def _garbage(payload: bytes, address: tuple[str, int]) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        sock.recv(20)  # the greeting: magic and the server nonce
        sock.sendall(payload)
        sock.settimeout(5)
        try:
            while sock.recv(4096):  # the server must close the connection
                pass
        except OSError:
            pass


def _send_garbage_then_work(n_events: int) -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.task import context, send_event

    hvd.init()
    address = tuple(context._client.address)
    if hvd.rank() == 0:
        frames = [
            os.urandom(4096),  # noise
            b"SEv1" + struct.pack("!I", 2**31),  # a length far over the frame limit
            b"SEv1" + struct.pack("!I", 64) + os.urandom(64 + 32),  # unsigned frame
            b"SEv1" + struct.pack("!I", 1000) + b"x" * 10,  # truncated, then closed
            b"SEv2" + os.urandom(16 + 32),  # a handshake answer without the secret
            b"",  # connect and close at once
        ]
        for frame in frames:
            _garbage(frame, address)
    hvd.barrier()
    for i in range(n_events):
        send_event("tick", i)
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="after")
    return {"rank": hvd.rank(), "total": float(total[0])}


def test_driver_service_survives_garbage_and_serves_the_ranks(spark):
    events: list[tuple[int, str, int]] = []
    started = time.monotonic()
    out = spark_estimators.run(
        _send_garbage_then_work, args=(3,), num_proc=2, spark=spark, start_timeout=START_S,
        event_callback=lambda rank, kind, data: events.append((rank, kind, data)),
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert out == [{"rank": 0, "total": 3.0}, {"rank": 1, "total": 3.0}]
    # Every event of both ranks arrived after the garbage: the service kept serving.
    assert sorted(events) == [(r, "tick", i) for r in (0, 1) for i in range(3)]
    assert elapsed < 60, f"took {elapsed:.1f}s"


def _kill_my_spark_worker(clock: str) -> int:
    import os
    import signal
    import time

    import spark_estimators.collective as hvd

    hvd.init()
    hvd.barrier()
    if hvd.rank() == 1:
        _stamp(clock)
        # Our parent is the PySpark worker running this rank's Spark task.
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(120)  # both ranks would run long: the launcher must stop them
    return hvd.rank()


def test_executor_python_worker_dying_fails_the_job_and_frees_the_ranks(spark, clock):
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(
            _kill_my_spark_worker, args=(str(clock),), num_proc=2, spark=spark,
            start_timeout=START_S,
        )  # fmt: skip
    waited = seconds_since_fault(clock)
    assert waited < STOP_BOUND_S, f"run() returned {waited:.1f}s after the fault"
    err = info.value
    assert 1 in err.failed_ranks
    assert "lost its connection to the driver" in err.worker_failures[1].message
    assert fault_time(clock) > 0
    # The orphaned rank process killed itself (stdin lifeline); the autouse fixture checks it.
    # The session stays usable: Spark starts a new Python worker for the next job.
    assert spark_estimators.run(_rank_of, num_proc=2, spark=spark, start_timeout=START_S) == [0, 1]


def _rank_of() -> int:
    import os

    return int(os.environ["RANK"])
