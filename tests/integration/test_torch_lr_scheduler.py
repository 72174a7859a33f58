"""TorchEstimator with a learning-rate scheduler (issue 32 item 5), 2 ranks on real Spark.

``LearningRateScheduler(scheduler, interval=...)`` steps a torch scheduler built on the estimator's
optimizer; ``scale_lr`` scales the whole schedule (``OneCycleLR``'s ``max_lr`` too), the epoch's
``lr`` is in the history, and the schedule's state is checkpointed, so a hot start goes on with it.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import LearningRateScheduler, TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROWS, BATCH, RANKS = 256, 16, 2
STEPS = ROWS // RANKS // BATCH  # optimizer steps per epoch on each rank: 8


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4))
    y = x @ np.array([1.5, -2.0, 0.5, 3.0]) + 0.7
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(ROWS)]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("lr-store")))


def estimator(store_, make_scheduler, interval="epoch", **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    opts = dict(
        num_proc=RANKS,
        store=store_,
        model=model,
        optimizer=optimizer,
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=BATCH,
        epochs=3,
        random_seed=1,
        verbose=0,
        callbacks=[LearningRateScheduler(make_scheduler(optimizer), interval=interval)],
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_epoch_schedule_is_scaled_with_the_learning_rate(df, store, tmp_path):
    fitted = estimator(store, step_lr).fit(df)
    history = fitted.getHistory()
    # lr 0.01 x 2 ranks, halved after every epoch.
    np.testing.assert_allclose(history["lr"], [0.02, 0.01, 0.005], rtol=1e-9)
    assert history["loss"][-1] < history["loss"][0]
    # The fitted model predicts the same after save/load, and keeps the schedule's history.
    fitted.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getHistory()["lr"] == history["lr"]
    a = [r["y__output"] for r in fitted.transform(df).collect()]
    b = [r["y__output"] for r in loaded.transform(df).collect()]
    assert a == b
    unscaled = estimator(store, step_lr, scale_lr=False).fit(df).getHistory()
    np.testing.assert_allclose(unscaled["lr"], [0.01, 0.005, 0.0025], rtol=1e-9)


def test_hot_start_goes_on_with_the_schedule(df, store):
    first = estimator(store, step_lr, epochs=2, run_id="lr_hot").fit(df)
    np.testing.assert_allclose(first.getHistory()["lr"], [0.02, 0.01], rtol=1e-9)
    resumed = estimator(store, step_lr, epochs=4, run_id="lr_hot").fit(df)
    # Restarting the schedule would give 0.02 again at epoch 2.
    np.testing.assert_allclose(resumed.getHistory()["lr"], [0.02, 0.01, 0.005, 0.0025], rtol=1e-9)


def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3 * STEPS)


def reference_one_cycle(max_lr, steps):
    """The rate after ``steps`` steps of the same OneCycleLR on one process."""
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=3 * STEPS)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize(("scale_lr", "max_lr"), [(True, 0.2), (False, 0.1)])
def test_per_step_one_cycle_peaks_at_the_scaled_max_lr(df, store, scale_lr, max_lr):
    history = estimator(store, one_cycle, interval="step", scale_lr=scale_lr).fit(df).getHistory()
    # The epoch's lr is the rate after its last step: the schedule stepped once per batch.
    want = [reference_one_cycle(max_lr, STEPS * (e + 1)) for e in range(2)]
    np.testing.assert_allclose(history["lr"][:2], want, rtol=1e-6)


def test_reduce_on_plateau_reads_the_monitored_metric(df, store):
    def plateau(opt):
        # An absolute threshold of 1e9: only the first epoch improves on the (infinite) best.
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.5, patience=0, threshold=1e9, threshold_mode="abs"
        )

    history = estimator(store, plateau, validation=0.25).fit(df).getHistory()
    np.testing.assert_allclose(history["lr"], [0.02, 0.02, 0.01], rtol=1e-9)


def test_scheduler_must_be_a_scheduler():
    with pytest.raises(TypeError, match="torch.optim.lr_scheduler scheduler"):
        LearningRateScheduler(object())
    with pytest.raises(ValueError, match="interval='batch'"):
        LearningRateScheduler(step_lr(torch.optim.SGD([torch.zeros(1)], lr=0.1)), "batch")
