"""A dead or silent peer makes collectives raise within the collective timeout, never hang."""

from __future__ import annotations

import pytest

from spark_estimators import envvars as ev
from spark_estimators.errors import RemoteError
from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

BIG = 16 * 1024 * 1024  # 64 MiB of float32: the peer dies while the transfer is under way


def _peer_dies_mid_allreduce() -> dict:
    import os
    import signal
    import time

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    hvd.barrier()
    tensor = torch.ones(BIG)
    if hvd.rank() == 1:
        hvd.allreduce_async_(tensor, op=hvd.Sum, name="big")
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    out = {}
    try:
        hvd.allreduce_(tensor, op=hvd.Sum, name="big")
    except CollectiveError as exc:
        out["error"] = str(exc)
    out["elapsed"] = time.monotonic() - started
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="next")
    except CollectiveError as exc:
        out["next_error"] = str(exc)
    out["next_elapsed"] = time.monotonic() - started
    hvd.shutdown()
    return out


def _peer_stops_calling() -> dict:
    import os
    import signal
    import time

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    pids = hvd.allgather_object(os.getpid())
    if hvd.rank() == 1:
        # Alive but never joins the allreduce; released by rank 0 once it has given up.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        signal.sigwait({signal.SIGUSR1})
        return {"released": True}
    started = time.monotonic()
    out = {}
    try:
        hvd.allreduce(torch.ones(4), name="lonely")
    except CollectiveError as exc:
        out["error"] = str(exc)
    out["elapsed"] = time.monotonic() - started
    os.kill(pids[1], signal.SIGUSR1)
    return out


def _peer_never_starts() -> dict:
    import time

    import spark_estimators.collective as hvd
    from spark_estimators.errors import RendezvousTimeoutError

    if int(__import__("os").environ[ev.SE_RANK]) == 1:
        return {"skipped_init": True}
    started = time.monotonic()
    try:
        hvd.init(start_timeout=3)
        return {"error": None}
    except RendezvousTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - started}


def test_dead_peer_mid_allreduce_raises_quickly_on_the_survivor():
    timeout = 30
    results = run_local(
        _peer_dies_mid_allreduce,
        num_proc=2,
        backend="gloo",
        env={ev.COLLECTIVE_TIMEOUT: str(timeout)},
        fail_fast=False,
        return_failures=True,
    )
    survivor, dead = results
    assert isinstance(dead, RemoteError) and "SIGKILL" in dead.message
    assert "'big' failed on rank 0" in survivor["error"]
    assert survivor["elapsed"] < timeout  # a closed connection is noticed, not waited out
    # later ops fail at once, naming the earlier failure, instead of hanging
    assert "broken" in survivor["next_error"] and "'big'" in survivor["next_error"]
    assert survivor["next_elapsed"] < 1.0


def test_silent_peer_times_out_within_the_collective_timeout():
    timeout = 3.0
    survivor, released = run_local(
        _peer_stops_calling,
        num_proc=2,
        backend="gloo",
        env={ev.COLLECTIVE_TIMEOUT: str(timeout)},
        fail_fast=False,
    )
    assert released == {"released": True}
    assert "'lonely' failed on rank 0" in survivor["error"]
    assert ev.COLLECTIVE_TIMEOUT in survivor["error"]
    assert timeout - 0.5 <= survivor["elapsed"] < timeout + 10


def test_rank_that_never_starts_fails_init_within_start_timeout():
    results = run_local(_peer_never_starts, num_proc=2, backend="gloo", fail_fast=False)
    assert results[1] == {"skipped_init": True}
    assert "could not meet the other 1 rank(s)" in results[0]["error"]
    assert results[0]["elapsed"] < 3 + 10
