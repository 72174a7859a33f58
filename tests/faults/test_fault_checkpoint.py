"""A store write failing halfway never leaves a corrupt checkpoint; a killed fit resumes.

* The store: a writer that fails halfway leaves the old file intact and no temporary behind.
* TorchEstimator: rank 0 SIGKILLed halfway through writing a checkpoint, and rank 1 SIGKILLed
  in the middle of an epoch; each fit fails within 10 s of the kill naming the rank, the last
  complete checkpoint is the one on disk, and a refit with the same run_id resumes from it
  (the finished epochs are not trained again) and converges.
* ``elastic=True``: the same kill is recovered inside the same ``fit`` (relaunch from the last
  checkpoint); a rank dying at every attempt stops at ``reset_limit``.
"""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest
from faultlib import seconds_since_fault

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.checkpoint import read_info  # noqa: E402
from spark_estimators.errors import (  # noqa: E402
    ElasticResetLimitError,
    StoreError,
    TrainingFailedError,
)
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402
from spark_estimators.torch.remote import checkpoint_paths  # noqa: E402

STOP_BOUND_S = 10.0
RELAUNCH_BOUND_S = 60.0  # kill -> failure noticed, job relaunched, remaining epochs trained
START_S = 180  # rank start-up on a loaded 2-core machine; bounds count from the fault instead
N_FEATURES = 3
TRUE_W = np.array([2.0, -1.0, 0.5])


def test_store_write_failing_halfway_keeps_the_old_file(tmp_path):
    store = LocalStore(str(tmp_path))
    path = store.get_checkpoint_path("r") + "/checkpoint.pt"
    store.write_bytes_atomic(path, b"A" * 1000)

    def write_half_then_fail():
        with store.open_write(path, atomic=True) as out:
            out.write(b"B" * 500)
            raise OSError("disk full halfway")

    with pytest.raises((OSError, StoreError)):
        write_half_then_fail()
    assert store.read_bytes(path) == b"A" * 1000
    assert store.listdir(store.get_checkpoint_path("r")) == ["checkpoint.pt"]


# -- estimator -----------------------------------------------------------------------------------
class Fragile(torch.nn.Module):
    """A linear model whose ``kill_rank`` SIGKILLs itself on forward call ``kill_at``."""

    def __init__(self, kill_at=None, kill_rank=1, clock="", once=False):
        super().__init__()
        self.fc = torch.nn.Linear(N_FEATURES, 1)
        self.kill_at, self.kill_rank, self.clock, self.calls = kill_at, kill_rank, clock, 0
        self.once = once  # only when the clock file does not exist yet (the first attempt)

    def forward(self, x):
        import os
        import signal
        import time

        self.calls += 1
        if (
            self.kill_at == self.calls
            and os.environ.get("RANK") == str(self.kill_rank)
            and not (self.once and os.path.exists(self.clock))
        ):
            with open(self.clock, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.fc(x)


class TearCheckpoint:
    """Callback: on rank 0 at ``epoch``, the checkpoint write dies halfway (SIGKILL)."""

    def __init__(self, epoch, clock):
        self.epoch, self.clock = epoch, clock

    def on_epoch_end(self, epoch, logs):
        import os
        import signal
        import time

        from spark_estimators.store.base import StoreBase

        if epoch != self.epoch or os.environ.get("RANK") != "0":
            return
        original = StoreBase.write_bytes_atomic
        clock = self.clock

        def torn(store, path, data):
            if not path.endswith("checkpoint.pt"):
                return original(store, path, data)
            with store.open_write(path, atomic=True) as out:
                out.write(data[: len(data) // 2])
                out.flush()
                with open(clock, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return None

        StoreBase.write_bytes_atomic = torn


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(256, N_FEATURES))
    y = x @ TRUE_W - 0.3
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


class DieBeforeInfo:
    """Callback: on rank 0 at ``epoch``, SIGKILL after ``checkpoint.pt``, before its info file."""

    def __init__(self, epoch, clock):
        self.epoch, self.clock = epoch, clock

    def on_epoch_end(self, epoch, logs):
        import os
        import signal
        import time

        from spark_estimators.store.base import StoreBase

        if epoch != self.epoch or os.environ.get("RANK") != "0":
            return
        original = StoreBase.write_bytes_atomic
        clock = self.clock

        def die_at_info(store, path, data):
            if path.endswith("checkpoint.json"):
                with open(clock, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(store, path, data)

        StoreBase.write_bytes_atomic = die_at_info


class EpochLog:
    """Callback: rank 0 appends every epoch it starts to a file (survives the process)."""

    def __init__(self, path):
        self.path = path

    def on_epoch_begin(self, epoch, logs):
        import os

        if os.environ.get("RANK") == "0":
            with open(self.path, "a") as f:
                f.write(f"{epoch}\n")


def _estimator(store, run_id, model, epochs, callbacks=(), **extra):
    torch.manual_seed(0)
    model.fc.reset_parameters()
    return TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,  # 256 rows / 2 ranks / 16 = 8 steps per epoch and rank
        epochs=epochs,
        random_seed=3,
        run_id=run_id,
        callbacks=list(callbacks),
        start_timeout=START_S,
        verbose=0,
        **extra,
    )


def _saved_epoch(store, run_id):
    ckpt, _ = checkpoint_paths(store, run_id)
    state = torch.load(io.BytesIO(store.read_bytes(ckpt)), weights_only=False)
    info = read_info(store, run_id, "torch")
    return int(state["epoch"]), (
        None if info is None else {"epoch": info.epoch, "history": list(info.history)}
    )


def _resume_and_check(store, run_id, df, saved_history, epochs):
    started = time.monotonic()
    model = _estimator(store, run_id, Fragile(), epochs).fit(df)
    history = model.getHistory()
    done = len(saved_history)
    assert [h["epoch"] for h in history] == list(range(epochs))
    assert history[:done] == saved_history  # resumed: the saved epochs were not trained again
    assert history[done]["loss"] < saved_history[0]["loss"]  # from the saved weights, not anew
    w = model.getModel().fc.weight.detach().numpy().ravel()
    np.testing.assert_allclose(w, TRUE_W, atol=0.1)
    return time.monotonic() - started


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torn_checkpoint_write_is_never_loaded_and_refit_resumes(df, tmp_path, clock):
    store = LocalStore(str(tmp_path / "store"))
    run_id = "torn"
    est = _estimator(store, run_id, Fragile(), 4, [TearCheckpoint(epoch=1, clock=str(clock))])
    with pytest.raises(TrainingFailedError) as info:
        est.fit(df)
    waited = seconds_since_fault(clock)
    assert waited < STOP_BOUND_S, f"fit failed {waited:.1f}s after the kill"
    assert 0 in info.value.failed_ranks and "SIGKILL" in info.value.worker_failures[0].message
    # The half-written temporary is there (the write really was torn) but hidden and ignored;
    # checkpoint.pt is still epoch 0's complete checkpoint, and the info file names epoch 0.
    ckpt_dir = os.path.dirname(checkpoint_paths(store, run_id)[0])
    names = os.listdir(ckpt_dir)
    assert sorted(n for n in names if not n.startswith(".")) == ["checkpoint.json", "checkpoint.pt"]
    assert any(n.startswith(".checkpoint.pt.tmp-") for n in names), names
    epoch, info_file = _saved_epoch(store, run_id)
    assert epoch == 0 and info_file is not None and info_file["epoch"] == 0
    _resume_and_check(store, run_id, df, info_file["history"], epochs=6)


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_rank_killed_mid_epoch_refit_resumes_from_last_checkpoint(df, tmp_path, clock):
    store = LocalStore(str(tmp_path / "store"))
    run_id = "midepoch"
    # 8 steps per epoch: forward call 20 is step 4 of epoch 2 on rank 1.
    fragile = Fragile(kill_at=20, kill_rank=1, clock=str(clock))
    with pytest.raises(TrainingFailedError) as info:
        _estimator(store, run_id, fragile, 4).fit(df)
    waited = seconds_since_fault(clock)
    assert waited < STOP_BOUND_S, f"fit failed {waited:.1f}s after the kill"
    assert info.value.failed_ranks and set(info.value.failed_ranks) <= {0, 1}
    epoch, info_file = _saved_epoch(store, run_id)
    assert epoch == 1 and info_file is not None and info_file["epoch"] == 1
    assert [h["epoch"] for h in info_file["history"]] == [0, 1]
    _resume_and_check(store, run_id, df, info_file["history"], epochs=6)
    if 1 not in info.value.failed_ranks:
        pytest.xfail(
            "launcher race: rank 0's CollectiveError reached the driver before rank 1's "
            "SIGKILL report, so the error blamed rank 0; see docs/reliability.md"
        )
    assert "SIGKILL" in info.value.worker_failures[1].message


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_elastic_fit_relaunches_from_last_checkpoint_within_the_same_fit(
    df, tmp_path, clock, caplog
):
    store = LocalStore(str(tmp_path / "store"))
    epochs_log = tmp_path / "epochs"
    # Forward call 20 of rank 1 is step 4 of epoch 2; the relaunched rank 1 is spared (once).
    fragile = Fragile(kill_at=20, kill_rank=1, clock=str(clock), once=True)
    est = _estimator(
        store, "elastic", fragile, 4, [EpochLog(str(epochs_log))], elastic=True, reset_limit=2
    )
    with caplog.at_level("WARNING", logger="spark_estimators.core.estimator"):
        model = est.fit(df)
    recovered = seconds_since_fault(clock)  # the fit returned this long after the kill
    assert recovered < RELAUNCH_BOUND_S, f"fit returned {recovered:.1f}s after the kill"
    # Epochs 0 and 1 were checkpointed and not trained again; epoch 2 was cut short and re-run.
    started = [int(line) for line in epochs_log.read_text().split()]
    assert started == [0, 1, 2, 2, 3]
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["loss"] < 0.05 * history[0]["loss"]
    weights = model.getModel().fc.weight.detach().numpy().ravel()
    np.testing.assert_allclose(weights, TRUE_W, atol=0.1)
    warnings = [r.getMessage() for r in caplog.records if "relaunching" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "SIGKILL" in warnings[0] and "reset 1 of at most 2" in warnings[0]
    assert "with 2 ranks" in warnings[0]


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_elastic_fit_stops_at_reset_limit(df, tmp_path, clock):
    store = LocalStore(str(tmp_path / "store"))
    epochs_log = tmp_path / "epochs"
    fragile = Fragile(kill_at=3, kill_rank=1, clock=str(clock))  # dies at every attempt
    est = _estimator(
        store, "doomed", fragile, 3, [EpochLog(str(epochs_log))], elastic=True, reset_limit=1
    )
    with pytest.raises(ElasticResetLimitError) as info:
        est.fit(df)
    assert seconds_since_fault(clock) < STOP_BOUND_S  # the last attempt's kill -> the error
    message = str(info.value)
    assert "reset_limit=1 reached after 2 failed attempts" in message
    assert "attempt 1: " in message and "attempt 2: " in message and "SIGKILL" in message
    assert epochs_log.read_text().split() == ["0", "0"]  # two attempts, both died in epoch 0


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_death_between_checkpoint_and_info_file_does_not_repeat_the_epoch(df, tmp_path, clock):
    store = LocalStore(str(tmp_path / "store"))
    run_id, epochs_log = "between", tmp_path / "epochs"
    killer = DieBeforeInfo(epoch=1, clock=str(clock))
    est = _estimator(store, run_id, Fragile(), 4, [killer, EpochLog(str(epochs_log))])
    with pytest.raises(TrainingFailedError):
        est.fit(df)
    assert seconds_since_fault(clock) < STOP_BOUND_S
    # checkpoint.pt holds epoch 1, the info file still names epoch 0: the torn window.
    epoch, info_file = _saved_epoch(store, run_id)
    assert epoch == 1 and info_file is not None and info_file["epoch"] == 0
    model = _estimator(store, run_id, Fragile(), 4, [EpochLog(str(epochs_log))]).fit(df)
    # The refit went on after epoch 1 (from checkpoint.pt), without training it again.
    assert [int(e) for e in epochs_log.read_text().split()] == [0, 1, 2, 3]
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[0] == info_file["history"][0]
    assert history[3]["loss"] < history[0]["loss"]
    _, info_after = _saved_epoch(store, run_id)
    assert info_after["epoch"] == 3 and [h["epoch"] for h in info_after["history"]] == [0, 1, 2, 3]
