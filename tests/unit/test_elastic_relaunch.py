"""The estimators' elastic relaunch policy (no Spark job: the slot count is injected)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spark_estimators.core import session  # noqa: E402
from spark_estimators.core.backend import SparkBackend  # noqa: E402
from spark_estimators.errors import RemoteError, TrainingFailedError  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402


def _estimator(**kw):
    model = torch.nn.Linear(2, 1)
    return TorchEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        elastic=True,
        **kw,
    )


def _failure(rank=1):
    return TrainingFailedError(
        "rank 1 failed",
        {rank: RemoteError(rank, "h", "the rank process was killed by signal SIGKILL", "", -9)},
    )


@pytest.fixture
def slots(monkeypatch):
    box = {"free": None, "asked": []}

    def fake_slots(spark, needed=0, wait_s=0.0):
        box["asked"].append((needed, wait_s))
        return box["free"]

    monkeypatch.setattr(session, "available_task_slots", fake_slots)
    monkeypatch.setattr(session, "get_spark", lambda spark=None: object())
    return box


@pytest.mark.parametrize(
    ("free", "min_num_proc", "expected"),
    [
        (4, None, 4),  # all slots back: same size
        (3, None, 4),  # min_num_proc defaults to num_proc: never shrink (run() waits/fails)
        (3, 2, 3),  # enough for min_num_proc: go on with the free slots
        (1, 2, 4),  # below min_num_proc: keep the size (the admission check explains)
        (None, 2, 4),  # unknown (dynamic allocation): keep the size
    ],
)
def test_relaunch_size(slots, caplog, free, min_num_proc, expected):
    slots["free"] = free
    est = _estimator(num_proc=4, min_num_proc=min_num_proc, reset_limit=3)
    with caplog.at_level("WARNING", logger="spark_estimators.core.estimator"):
        backend = est._relaunch_backend(SparkBackend(num_proc=4), _failure(), reset=1)
    assert backend.num_processes() == expected
    assert slots["asked"] == [(4, 30.0)]
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"with {expected} ranks" in message and "reset 1 of at most 3" in message
    assert "rank 1: the rank process was killed by signal SIGKILL (exit code -9)" in message


def test_reset_limit_error_lists_every_attempt():
    est = _estimator(num_proc=2, reset_limit=1)
    error = est._reset_limit_error([_failure(1), _failure(0)])
    text = str(error)
    assert "reset_limit=1 reached after 2 failed attempts" in text
    assert "attempt 1: rank 1: the rank process was killed" in text
    assert "attempt 2: rank 0: the rank process was killed" in text
    assert error.failed_ranks == [0]  # the last attempt's failures, with their tracebacks
