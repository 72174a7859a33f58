"""One owner per run_id (issue 18): a second live fit on a run fails fast, the first goes on.

The first fit is held inside its first forward pass until the test writes a release file, so the
second fit always meets a live first fit (files for synchronisation, no sleeps).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from pyspark.ml.linalg import Vectors

from spark_estimators.errors import RunInUseError, TrainingFailedError
from spark_estimators.store import LocalStore
from spark_estimators.store.lock import LockInfo, lock_path

torch = pytest.importorskip("torch")

from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_FEATURES = 4
TRUE_W = np.array([1.5, -2.0, 0.5, 3.0])


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(N_FEATURES, 1)

    def forward(self, x):
        return self.fc(x)


class WaitsForRelease(Linear):
    """Its first forward pass on every rank waits until ``release_file`` exists."""

    def __init__(self, release_file):
        super().__init__()
        self.release_file = release_file

    def forward(self, x):
        deadline = time.monotonic() + 120
        while not os.path.exists(self.release_file) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.fc(x)


class Fails(Linear):
    def forward(self, x):
        # Only in training mode: the driver's preflight pass (eval mode) succeeds, so the failure
        # happens on the ranks, after the run lock was taken.
        if self.training:
            raise RuntimeError("planted failure")
        return super().forward(x)


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, N_FEATURES))
    y = x @ TRUE_W + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


def estimator(store, model, run_id, epochs=2):
    return TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=epochs,
        random_seed=1,
        verbose=0,
        run_id=run_id,
    )


def test_second_fit_on_a_live_run_fails_fast_and_the_first_succeeds(df, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    release = tmp_path / "release"
    first: dict = {}

    def fit_first():
        try:
            first["model"] = estimator(store, WaitsForRelease(str(release)), "shared").fit(df)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            first["error"] = exc

    thread = threading.Thread(target=fit_first)
    thread.start()
    try:
        lock = lock_path(store, "shared")
        deadline = time.monotonic() + 60
        while not store.exists(lock) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)  # waiting for the first fit's lock file to appear
        assert store.exists(lock), f"the first fit never took the lock: {first}"
        owner = LockInfo.from_bytes(store.read_bytes(lock))
        assert owner is not None

        torch.manual_seed(1)
        second = estimator(store, Linear(), "shared")
        started = time.monotonic()
        with pytest.raises(RunInUseError) as err:
            second.fit(df)
        assert time.monotonic() - started < 5
        assert "run_id='shared'" in str(err.value) and owner.owner in str(err.value)
        # The refused fit wrote nothing: the lock is still the first fit's.
        assert LockInfo.from_bytes(store.read_bytes(lock)).token == owner.token
    finally:
        release.write_text("go")
        thread.join(240)
    assert "error" not in first, first.get("error")
    assert len(first["model"].getHistory()) == 2
    assert not store.exists(lock_path(store, "shared"))  # released after success
    # The run is free again: a refit on it resumes (2 more epochs after the first fit's 2).
    torch.manual_seed(1)
    again = estimator(store, Linear(), "shared", epochs=4).fit(df)
    assert [h["epoch"] for h in again.getHistory()] == [0, 1, 2, 3]
    assert not store.exists(lock_path(store, "shared"))


def test_lock_is_released_after_a_failed_fit(df, tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    with pytest.raises(TrainingFailedError, match="planted failure"):
        estimator(store, Fails(), "fails").fit(df)
    assert not store.exists(lock_path(store, "fails"))


def test_stale_lock_of_a_dead_fit_is_taken_over(df, tmp_path, caplog):
    store = LocalStore(str(tmp_path / "store"))
    old = time.time() - 3600
    dead = LockInfo("stale", "gone:4242:0000", "gone", 4242, "tok", old, old)
    store.write_bytes(lock_path(store, "stale"), dead.to_bytes())
    torch.manual_seed(1)
    with caplog.at_level("WARNING", logger="spark_estimators.store.lock"):
        model = estimator(store, Linear(), "stale").fit(df)
    assert len(model.getHistory()) == 2
    assert any("gone:4242:0000" in r.getMessage() for r in caplog.records)
    assert not store.exists(lock_path(store, "stale"))
