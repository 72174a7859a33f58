"""A reset waits for live members of the last round up to the ranks' collective timeout.

Found by the multi-host harness (tests/multihost, issue 42): after a host was lost, survivors
whose ring peers had already left for the reset sat in a collective until it timed out, and a
reset with ``elastic_timeout`` below the collective timeout aborted ("only 2 worker(s) at the
rendezvous ... need 4") although enough ranks were alive. The driver service (real RPC on
127.0.0.1) now waits for such stragglers up to the collective timeout + a grace, and no longer.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import pytest

from spark_estimators.driver.rpc import RpcClient
from spark_estimators.elastic.service import ElasticDriverService, ElasticPolicy

ELASTIC_TIMEOUT, COLLECTIVE_TIMEOUT, GRACE = 0.3, 2.0, 0.5


class Job:
    """An elastic service with three joined workers that formed round 1."""

    def __init__(self) -> None:
        policy = ElasticPolicy(
            num_proc=3, min_num_proc=2, max_num_proc=3, start_timeout=30,
            elastic_timeout=ELASTIC_TIMEOUT, reset_limit=None, rejoin_wait=0.0,
        )  # fmt: skip
        secret = os.urandom(32)
        env = {"SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT)}
        self.svc = ElasticDriverService(policy, secret, pickle.dumps(None), env=env)
        self.svc.straggler_grace = GRACE
        self.clients = [RpcClient(self.svc.address, secret) for _ in range(3)]
        self.ids = [
            c.call("join", {"index": i, "attempt": 0, "host": f"h{i}", "host_hash": f"h{i}",
                            "address": "127.0.0.1"})["worker_id"]
            for i, c in enumerate(self.clients)
        ]  # fmt: skip
        first = self.rendezvous([0, 1, 2])
        assert {a["settings"].size for a in first.values()} == {3}

    def rendezvous(self, workers: list[int], start: bool = True) -> dict[int, Any]:
        """Each worker's rendezvous answer (or the error it raised), in threads."""
        answers: dict[int, Any] = {}

        def one(i: int) -> None:
            try:
                answers[i] = self.clients[i].call(
                    "rendezvous", {"worker_id": self.ids[i], "port": 0}, timeout=30
                )
            except Exception as exc:  # noqa: BLE001 - the test asserts on it
                answers[i] = exc

        self.threads = [threading.Thread(target=one, args=(i,)) for i in workers]
        for t in self.threads:
            t.start()
        if start:
            self.join()
        self.answers = answers
        return answers

    def join(self) -> None:
        for t in self.threads:
            t.join(30)
            assert not t.is_alive()

    def lose_worker_2(self) -> None:
        self.clients[2].call(
            "failure",
            {"worker_id": self.ids[2], "host": "h2", "message": "host lost", "traceback": ""},
        )

    def wait_pending(self, seconds: float) -> None:
        """Until the reset's rendezvous has been pending ``seconds`` (a state of the service)."""
        deadline = time.monotonic() + 10
        while True:
            since = self.svc.state.pending_since
            if since is not None and time.monotonic() - since >= seconds:
                return
            assert time.monotonic() < deadline
            time.sleep(0.05)  # polling the service's own clock-based state

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.svc.server.close()


@pytest.fixture
def job():
    j = Job()
    try:
        yield j
    finally:
        j.close()


def test_a_reset_waits_past_elastic_timeout_for_a_live_member_of_the_last_round(job):
    job.lose_worker_2()
    answers = job.rendezvous([0], start=False)  # worker 1 is "in a collective"
    job.wait_pending(ELASTIC_TIMEOUT * 3)
    assert job.svc.state.abort_reason is None
    late = job.rendezvous([1])
    job.threads = []
    deadline = time.monotonic() + 10
    while 0 not in answers:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # worker 0's call returns once the round is formed
    settings = {i: a["settings"] for i, a in {**answers, **late}.items()}
    assert sorted(s.rank for s in settings.values()) == [0, 1]
    assert {s.size for s in settings.values()} == {2}
    assert job.svc.state.resets == 1


def test_a_reset_gives_up_on_stragglers_after_the_collective_timeout(job):
    job.lose_worker_2()
    started = time.monotonic()
    answers = job.rendezvous([0])  # worker 1 never comes
    took = time.monotonic() - started
    assert isinstance(answers[0], Exception)
    reason = job.svc.state.abort_reason
    assert reason is not None
    assert "only 1 worker(s) at the rendezvous after the collective timeout + grace=2.5s" in reason
    assert COLLECTIVE_TIMEOUT + GRACE <= took < COLLECTIVE_TIMEOUT + GRACE + 5
