"""issue 25 item 1: ``backward_passes_per_step`` larger than a rank's steps per epoch.

Horovod's test_fit_model trains ``num_proc=2, batch_size=1, backward_passes_per_step=3`` on a
4-row frame: 2 reader steps per rank, 3 passes per optimizer step. It raised
``RuntimeError: generator raised StopIteration``; now the epoch has 3 steps, the third wraps
around the shard, and each optimizer step averages 3 accumulated passes over the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

X = [1.0, -2.0, 0.5]
Y = 3.0
LR = 0.01
EPOCHS = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def test_more_passes_per_step_than_steps_per_epoch(spark, tmp_path):
    # Equal rows: every pass has the same gradient whichever rows a rank holds or repeats, so
    # the result is exact: one optimizer step per epoch with the mean of 3 passes' gradients.
    df = spark.createDataFrame([(Vectors.dense(X), Y)] * 4, ["features", "y"])
    model = _model()
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=1,
        epochs=EPOCHS,
        backward_passes_per_step=3,
        scale_lr=False,
        verbose=0,
    )
    fitted = est.fit(df)

    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    x, y = torch.tensor([X]), torch.tensor([[Y]])
    losses = []
    for _ in range(EPOCHS):
        opt.zero_grad()
        for _ in range(3):  # local accumulation of loss / 3, as horovod's estimator
            loss = torch.nn.functional.mse_loss(reference(x), y)
            (loss / 3).backward()
        losses.append(float(loss.detach()))
        opt.step()
    got = fitted.getModel().state_dict()
    for name, want in reference.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    history = fitted.getHistory()
    assert [round(h["loss"], 4) for h in history] == [round(v, 4) for v in losses]
    # the fitted model predicts with the trained weights
    pred = fitted.transform(df).collect()[0]
    want_pred = float(reference(x).detach())
    assert pred[fitted.getOutputCols()[0]] == pytest.approx(want_pred, rel=1e-5)


def test_steps_not_a_multiple_of_the_passes_round_up(spark, tmp_path):
    # 10 rows, 2 ranks, batch 1: 5 reader steps per rank; 2 passes per step -> 6 steps, 3
    # optimizer steps per epoch (rounding down to 4 skipped a row of each shard every epoch).
    df = spark.createDataFrame([(Vectors.dense(X), Y)] * 10, ["features", "y"])
    model = _model()
    fitted = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=1,
        epochs=1,
        backward_passes_per_step=2,
        scale_lr=False,
        verbose=0,
    ).fit(df)
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    x, y = torch.tensor([X]), torch.tensor([[Y]])
    for _ in range(3):
        opt.zero_grad()
        for _ in range(2):
            (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
        opt.step()
    got = fitted.getModel().state_dict()
    for name, want in reference.state_dict().items():
        np.testing.assert_allclose(got[name].numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
