"""Two ranks train exactly what one process trains on the union of their batches.

With plain SGD and one batch per rank per epoch (batch_size = the rank's shard), the averaged
gradient of the two ranks is the full-batch gradient of all rows, whatever the row order. So
TorchEstimator(num_proc=2) must end with the weights of full-batch gradient descent in plain
torch: a sum instead of a mean, a missing allreduce, a learning rate scaled behind the user's
back, or a rank that trains on the wrong rows all move the weights away from the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROWS, EPOCHS, LR = 600, 5, 0.1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_two_ranks_match_full_batch_gradient_descent(spark, tmp_path):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 4))
    y = np.sin(x @ np.array([1.0, -0.5, 0.25, 2.0])) + 0.1
    df = spark.createDataFrame(
        [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(ROWS)], ["features", "y"]
    )

    model = _model()
    fitted = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=ROWS // 2,  # one step per rank per epoch: its whole shard
        epochs=EPOCHS,
        scale_lr=False,
        verbose=0,
    ).fit(df)

    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32).reshape(-1, 1)
    losses = []
    for _ in range(EPOCHS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(xt), yt)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    trained = fitted.getModel().state_dict()
    want = reference.state_dict()
    assert trained.keys() == want.keys()
    moved = float((want["0.weight"] - _model().state_dict()["0.weight"]).abs().max())
    assert moved > 1e-3  # the reference did train, so equal weights mean equal training
    for name in want:
        np.testing.assert_allclose(trained[name].numpy(), want[name].numpy(), rtol=1e-4, atol=1e-5)
    # Each epoch's reported loss is the mean over all rows before that epoch's step.
    history = [h["loss"] for h in fitted.getHistory()]
    np.testing.assert_allclose(history, losses, rtol=1e-4)
