"""Issue 27 item 2: a helper module imported from sys.path travels by value to the ranks.

A ``helpers.py`` next to the notebook is importable in the driver (its folder is on
``sys.path``) but not on the ranks. The model's ``forward`` calls one of its functions through a
module global and the loss is a ``functools.partial`` of another: before, the ranks failed with
``ModuleNotFoundError``, because only the modules defining the travelling objects themselves
went by value, not the modules their code reads.
"""

from __future__ import annotations

import functools
import importlib
import sys
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators._base.pickling import user_modules  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

HELPERS = """
import torch


def scale(x):
    return 2.0 * x


class Halve(torch.nn.Module):
    def forward(self, x):
        return 0.5 * x


def weighted_mse(output, label, weight):
    return weight * torch.mean((output - label) ** 2)
"""

_helpers = None  # the helper module, imported in the test as a notebook would


class NotebookNet(torch.nn.Module):
    """A model written in the notebook: its forward reads the helper module as a global."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return _helpers.Halve()(_helpers.scale(self.fc(x)))


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    name = f"nb_helpers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.setitem(globals(), "_helpers", module)
    yield module
    sys.modules.pop(name, None)


def test_the_finder_follows_globals_and_partials(helpers):
    loss = functools.partial(helpers.weighted_mse, weight=2.0)
    assert helpers in user_modules([loss])
    assert helpers in user_modules([NotebookNet()])


def test_a_model_and_loss_using_a_sys_path_helper_module_train_on_spark(spark, tmp_path, helpers):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(256, 2))
    y = x @ [1.5, -0.5] + 0.25
    df = spark.createDataFrame(
        [(Vectors.dense(r.tolist()), float(v)) for r, v in zip(x, y)], ["features", "y"]
    )
    torch.manual_seed(0)
    net = NotebookNet()
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        loss=functools.partial(helpers.weighted_mse, weight=2.0),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=32,
        epochs=8,
        verbose=0,
    )
    model = est.fit(df)
    losses = [h["loss"] for h in model.getHistory()]
    assert losses[-1] < 0.2 * losses[0], losses
    out = model.transform(df).toPandas()
    pred = np.stack(out["y__output"].to_numpy()).astype(float).reshape(-1)
    assert np.abs(pred - out["y"].to_numpy()).mean() < 0.2
