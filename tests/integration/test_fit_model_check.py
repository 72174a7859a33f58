"""Issue 27 item 1: the model and loss run on a few real rows in the driver before the job.

Before, each of these failed on every rank with a raw torch error (a 37-67-line message and a
67-97-line traceback); now the fit fails in the driver with the fix in the first line.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def scalar_df(spark):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 3))
    rows = [(*map(float, r), float(i % 3)) for i, r in enumerate(x)]
    return spark.createDataFrame(rows, ["a", "b", "c", "label"])


@pytest.fixture(scope="module")
def vector_df(spark):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 3))
    rows = [(Vectors.dense(r.tolist()), float(i % 3)) for i, r in enumerate(x)]
    return spark.createDataFrame(rows, ["features", "label"])


def estimator(tmp_path, model, loss, features, **kw):
    opts = dict(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=loss,
        feature_cols=features,
        label_cols=["label"],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    opts.update(kw)
    return TorchEstimator(**opts)


def first_line(exc_info) -> str:
    return str(exc_info.value).splitlines()[0]


def test_scalar_feature_columns_into_a_one_input_model(scalar_df, tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(3, 1))
    est = estimator(tmp_path, net, torch.nn.MSELoss(), ["a", "b", "c"])
    with pytest.raises(ConfigurationError) as info:
        est.fit(scalar_df)
    line = first_line(info)
    assert "one model input per feature column" in line, line
    assert "VectorAssembler(inputCols=['a', 'b', 'c']" in line, line
    assert "takes 2 positional arguments but 4 were given" in str(info.value)


def test_class_ids_stored_as_double_for_a_cross_entropy_function(vector_df, tmp_path):
    net = torch.nn.Linear(3, 3)
    est = estimator(
        tmp_path, net, lambda out, y: torch.nn.functional.cross_entropy(out, y), ["features"]
    )
    with pytest.raises(ConfigurationError) as info:
        est.fit(vector_df)
    line = first_line(info)
    assert "int64 class indices" in line and "'label'" in line, line
    assert ".cast('long')" in line and "CrossEntropyLoss()" in line, line


def test_output_width_differs_from_the_label(vector_df, tmp_path):
    net = torch.nn.Linear(3, 2)
    est = estimator(tmp_path, net, torch.nn.MSELoss(), ["features"])
    with pytest.raises(ConfigurationError) as info:
        est.fit(vector_df)
    line = first_line(info)
    assert "outputs 2 value(s) per row but label column 'label' holds 1" in line, line
    assert "nn.Linear(..., 1)" in line, line


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def test_the_check_leaves_the_model_as_it_was(vector_df, tmp_path, caplog):
    torch.manual_seed(0)
    net = _Norm()
    net.bn.eval()  # a mixed state: it must come back exactly so
    before = {k: v.clone() for k, v in net.state_dict().items()}
    est = estimator(tmp_path, net, torch.nn.MSELoss(), ["features"], epochs=1)
    with caplog.at_level("DEBUG", logger="spark_estimators.core.training_run"):
        fitted = est.fit(vector_df)
    # the check ran: the fit's log reports its cost
    assert any("model check took" in r.getMessage() for r in caplog.records)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert net.training and net.fc.training and not net.bn.training
    assert len(fitted.getHistory()) == 1


def test_lightning_class_ids_stored_as_double(vector_df, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    est = LightningEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=Classifier(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    with pytest.raises(ConfigurationError) as info:
        est.fit(vector_df)
    line = first_line(info)
    assert "Classifier.training_step needs int64 class indices" in line, line
    assert "label column 'label'" in line and ".cast('long')" in line, line


def test_keras_output_width_differs_from_the_label(vector_df, tmp_path):
    keras = pytest.importorskip("keras")
    from spark_estimators.keras import KerasEstimator

    model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2)])
    est = KerasEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path / "store")),
        model=model,
        optimizer=keras.optimizers.SGD(learning_rate=0.01),
        loss="mse",
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    with pytest.raises(ConfigurationError) as info:
        est.fit(vector_df)
    line = first_line(info)
    assert "outputs 2 value(s) per row but label column 'label' holds 1" in line, line
    assert "keras.layers.Dense(1)" in line, line
