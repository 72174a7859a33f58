"""Elastic state semantics (in process) and run_elastic's argument checks.

The end-to-end elastic run (a rank SIGKILLed, the job recovers with exact sample counts) is in
tests/faults/test_fault_elastic.py, in its own local[2,4] session.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from spark_estimators.collective.api import elastic
from spark_estimators.errors import CollectiveError, ConfigurationError

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _solo_state(cls, **kwargs):
    return cls(bcast_object=lambda obj, root: obj, get_rank=lambda: 0, **kwargs)


def test_object_state_restores_the_last_commit():
    state = _solo_state(elastic.ObjectState, epoch=0, seen=np.zeros(3))
    state.epoch = 2
    state.seen[1] = 5
    state.commit()
    state.epoch = 3
    state.seen[2] = 7
    state.restore()
    assert state.epoch == 2
    assert state.seen.tolist() == [0, 5, 0]
    state.seen[0] = 1  # restore() hands out a copy: the commit stays intact
    state.restore()
    assert state.seen.tolist() == [0, 5, 0]


def test_torch_state_restores_model_and_optimizer():
    torch = pytest.importorskip("torch")
    from spark_estimators.collective.torch.elastic import TorchState

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = _solo_state(TorchState, model=model, optimizer=opt, step=0)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.step = 1
    state.commit()
    committed = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.step = 2
    assert not torch.equal(model.weight, committed)
    state.restore()
    assert torch.equal(model.weight.detach(), committed)
    assert state.step == 1
    assert len(opt.state_dict()["state"]) == 2  # momentum buffers came back too


def test_run_restores_resets_and_calls_reset_callbacks(monkeypatch):
    """A broken group: restore the commit, reset, call the callbacks, run again."""
    calls = {"reset": 0, "callback": 0, "broken": True}
    monkeypatch.setattr(elastic, "reset", lambda: calls.__setitem__("reset", calls["reset"] + 1))
    monkeypatch.setattr(elastic, "_group_broken", lambda: calls["broken"])
    monkeypatch.setattr("spark_estimators.collective.api.lifecycle.is_initialized", lambda: True)
    state = _solo_state(elastic.ObjectState, step=0)
    state.register_reset_callbacks([lambda: calls.__setitem__("callback", calls["callback"] + 1)])
    attempts = []

    @elastic.run
    def train(state, fail_at):
        attempts.append(state.step)
        while state.step < 6:
            state.step += 1
            if state.step == fail_at and len(attempts) == 1:
                raise CollectiveError("peer died")
            if state.step % 2 == 0:
                state.commit()
        return state.step

    assert train(state, 5) == 6
    assert attempts == [0, 4]  # the second attempt starts from the last commit (step 4)
    assert calls["reset"] == calls["callback"] == 1


def test_run_reraises_collective_errors_that_did_not_break_the_group(monkeypatch):
    monkeypatch.setattr(elastic, "_group_broken", lambda: False)
    monkeypatch.setattr("spark_estimators.collective.api.lifecycle.is_initialized", lambda: True)

    @elastic.run
    def train(state):
        raise CollectiveError("shapes differ between ranks")

    with pytest.raises(CollectiveError, match="shapes differ"):
        train(_solo_state(elastic.ObjectState, step=0))


def test_host_updates_interrupt_every_rank_through_rank_zero(monkeypatch):
    monkeypatch.setattr(elastic, "_host_update_hook", lambda: True)
    state = _solo_state(elastic.ObjectState, step=0)
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        state.commit()
    # A rank other than 0 does not ask the driver: it follows rank 0's broadcast answer.
    asked = []
    monkeypatch.setattr(elastic, "_host_update_hook", lambda: asked.append(1) or True)
    other = elastic.ObjectState(bcast_object=lambda obj, root: False, get_rank=lambda: 1, step=0)
    other.commit()
    assert asked == []


@pytest.mark.spark
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_proc": 2, "min_num_proc": 3}, "min_num_proc <= num_proc <= max_num_proc"),
        ({"num_proc": 2, "max_num_proc": 1}, "min_num_proc <= num_proc <= max_num_proc"),
        ({"num_proc": 3}, "num_proc=3 needs 3 concurrent Spark task slots"),
        ({"num_proc": 2, "reset_limit": -1}, "reset_limit must be None or an int >= 0"),
        ({"num_proc": 2, "elastic_timeout": 0}, "elastic_timeout must be > 0"),
        ({"num_proc": 0}, "num_proc must be a positive int"),
    ],
)
def test_bad_arguments_fail_in_the_driver(spark, kwargs, pattern):
    from spark_estimators.elastic import run_elastic

    with pytest.raises(ConfigurationError, match=pattern):
        run_elastic(lambda: None, spark=spark, **kwargs)


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_raising_rank_leads_the_error_with_its_exception():
    """The user's exception type, message and hint come first, not the rank process's exit or
    the executors' Java traces (issue 41); its own local[2,2] session, as elastic jobs need."""
    env = dict(os.environ)
    env.pop("SPARK_ESTIMATORS_TEST_SESSION", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "elastic_raise.py")],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["error"] == "TrainingFailedError"
    message = out["message"]
    first, second = message.splitlines()[:2]
    assert first == "ValueError: learning rate 7.5 is out of range; try 0.01", message[:3000]
    assert second.startswith("the elastic job failed: Spark stopped retrying a failed task")
    assert "without reporting a result" not in message
    assert "at org.apache.spark" not in message  # no executor Java traces
    assert "thrown from the Python worker" not in message  # nor the task's own error
    assert "in train" in message  # the rank's Python traceback is there, after the summary
