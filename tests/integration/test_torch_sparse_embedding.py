"""TorchEstimator with ``nn.Embedding(sparse=True)`` on 2 ranks (issue 32 item 4).

Sparse gradients failed with ``CollectiveError: ... reshape is not implemented for sparse
tensors; a peer rank probably died``. They are now allgathered (indices and values) as horovod
does, and the optimizers that take sparse gradients (SGD, SparseAdam, Adagrad) train.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

TARGETS = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 0.0, -0.5])


class SparseLookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(len(TARGETS), 1, sparse=True)

    def forward(self, idx):
        return self.emb(idx.squeeze(-1))


@pytest.fixture(scope="module")
def df(spark):
    rows = [(int(i % len(TARGETS)), float(TARGETS[i % len(TARGETS)])) for i in range(256)]
    return spark.createDataFrame(rows, ["idx", "y"]).cache()


@pytest.mark.parametrize(
    ("optimizer", "lr", "epochs"),
    [(torch.optim.SGD, 0.5, 8), (torch.optim.SparseAdam, 0.1, 10), (torch.optim.Adagrad, 0.5, 10)],
)
def test_sparse_embedding_trains_with_sparse_optimizers(df, tmp_path, optimizer, lr, epochs):
    torch.manual_seed(0)
    model = SparseLookup()
    fitted = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=optimizer(model.parameters(), lr=lr),
        loss=torch.nn.MSELoss(),
        feature_cols=["idx"],
        label_cols=["y"],
        batch_size=16,
        epochs=epochs,
        scale_lr=False,
        random_seed=1,
        verbose=0,
    ).fit(df)
    history = fitted.getHistory()
    assert history["loss"][-1] < 0.05 < history["loss"][0]
    learned = fitted.getModel().emb.weight.detach().numpy().ravel()
    np.testing.assert_allclose(learned, TARGETS, atol=0.25)
    out = fitted.transform(df).select("idx", "y__output").collect()
    np.testing.assert_allclose(
        [r["y__output"] for r in out], learned[[r["idx"] for r in out]], rtol=1e-5
    )
    path = str(tmp_path / "model")
    fitted.write().overwrite().save(path)
    again = TorchModel.load(path).transform(df).select("idx", "y__output").collect()
    assert [(r["idx"], r["y__output"]) for r in again] == [(r["idx"], r["y__output"]) for r in out]
