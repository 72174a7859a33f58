"""StringIndexer columns (doubles) as class labels and embedding indices in TorchEstimator (#32).

Spark's way to encode classes gives double columns; torch's classification losses and embedding
layers need int64. The driver picks those columns (spark_estimators.torch.indices), the ranks and
``transform`` cast them, and a fractional value is refused in the driver naming the column.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.feature import StringIndexer  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.batches import BatchConverter  # noqa: E402
from spark_estimators.data.metadata import ColumnInfo  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]

CENTERS = {"cat": [2.0, 0.0, 0.0, 0.0], "dog": [0.0, 2.0, 0.0, 0.0], "emu": [0.0, 0.0, 2.0, 2.0]}
CATEGORY_VALUE = {"red": -2.0, "green": 0.5, "blue": 3.0, "gray": 1.5}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(str(tmp_path_factory.mktemp("class-index-store")))


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


class EmbeddingRegressor(torch.nn.Module):
    """An index column through nn.Embedding next to a float column that must stay float."""

    def __init__(self, n_categories):
        super().__init__()
        self.emb = torch.nn.Embedding(n_categories, 4)
        self.fc = torch.nn.Linear(5, 1)

    def forward(self, idx, x):
        return self.fc(torch.cat([self.emb(idx).squeeze(1), x], dim=1))


def animals_df(spark, n=480, seed=0):
    rng = np.random.default_rng(seed)
    names = sorted(CENTERS)
    rows = []
    for i in range(n):
        name = names[i % len(names)]
        x = np.asarray(CENTERS[name]) + rng.normal(scale=0.5, size=4)
        rows.append((Vectors.dense(x.tolist()), name))
    raw = spark.createDataFrame(rows, ["features", "animal"])
    return StringIndexer(inputCol="animal", outputCol="label").fit(raw).transform(raw)


def colors_df(spark, n=400, seed=1):
    rng = np.random.default_rng(seed)
    names = sorted(CATEGORY_VALUE)
    rows = []
    for i in range(n):
        name = names[i % len(names)]
        x = float(rng.normal())
        rows.append((name, x, CATEGORY_VALUE[name] + 0.5 * x))
    raw = spark.createDataFrame(rows, ["color", "x", "y"])
    return StringIndexer(inputCol="color", outputCol="color_idx").fit(raw).transform(raw)


def test_string_indexer_label_trains_with_cross_entropy_and_transforms(spark, store):
    df = animals_df(spark).cache()
    assert dict(df.dtypes)["label"] == "double"
    torch.manual_seed(0)
    model = Classifier()
    est = TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=[accuracy],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["loss"] < 0.3
    assert history[-1]["accuracy"] > 0.95
    assert fitted.getIndexCols() == []  # a label is not an input of the model

    out = fitted.transform(df).select("features", "label", "label__output").collect()
    x = np.array([r["features"].toArray() for r in out], dtype=np.float32)
    got = np.array([r["label__output"] for r in out])
    with torch.no_grad():
        want = fitted.getModel()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    predicted = got.argmax(axis=1)
    labels = np.array([r["label"] for r in out])
    assert (predicted == labels).mean() > 0.95


def test_string_indexer_column_feeds_an_embedding(spark, store, tmp_path):
    df = colors_df(spark).cache()
    assert dict(df.dtypes)["color_idx"] == "double"
    torch.manual_seed(0)
    model = EmbeddingRegressor(len(CATEGORY_VALUE))
    est = TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["color_idx", "x"],
        label_cols=["y"],
        batch_size=32,
        epochs=6,
        random_seed=1,
        verbose=0,
    )
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert history[-1]["loss"] < 0.1 < history[0]["loss"]
    assert fitted.getIndexCols() == ["color_idx"]
    # the user's model keeps its hooks-free state: nothing of the driver's probe stays behind
    assert not est.getModel().emb._forward_pre_hooks

    path = str(tmp_path / "embedding_model")
    fitted.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert loaded.getIndexCols() == ["color_idx"]
    rows = df.select("color_idx", "x").collect()
    idx = torch.tensor([[int(r["color_idx"])] for r in rows], dtype=torch.int64)
    x = torch.tensor([[r["x"]] for r in rows], dtype=torch.float32)
    with torch.no_grad():
        want = fitted.getModel()(idx, x).numpy().ravel()
    for m in (fitted, loaded):
        got = np.array([r["y__output"] for r in m.transform(df).select("y__output").collect()])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["label", "embedding"])
def test_fractional_index_values_are_refused_in_the_driver(spark, store, which):
    rows = [(float(i % 3), float(i % 4), 0.1 * i, 0.2 * i) for i in range(40)]
    rows[17] = (1.5, 2.5, 1.7, 3.4)
    df = spark.createDataFrame(rows, ["cls", "cat", "x", "y"])
    torch.manual_seed(0)
    if which == "label":
        model: torch.nn.Module = torch.nn.Linear(1, 3)
        kwargs = dict(loss=torch.nn.CrossEntropyLoss(), feature_cols=["x"], label_cols=["cls"])
        column = "cls"
    else:
        model = EmbeddingRegressor(4)
        kwargs = dict(loss=torch.nn.MSELoss(), feature_cols=["cat", "x"], label_cols=["y"])
        column = "cat"
    est = TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batch_size=8,
        epochs=1,
        verbose=0,
        **kwargs,
    )
    with pytest.raises(ConfigurationError, match=rf"column '{column}'.*1 of its values.*\.5\)"):
        est.fit(df)


# -- the driver's choice, without Spark ---------------------------------------------------------

COLUMNS = {
    "idx": ColumnInfo("idx", "scalar", "float64", ()),
    "x": ColumnInfo("x", "array", "float64", (2,)),
    "probs": ColumnInfo("probs", "array", "float64", (3,)),
    "y": ColumnInfo("y", "scalar", "float64", ()),
    "k": ColumnInfo("k", "scalar", "int64", ()),
}


@pytest.mark.parametrize(
    ("loss", "label", "cast"),
    [
        (torch.nn.CrossEntropyLoss(), "y", True),
        (torch.nn.functional.cross_entropy, "y", True),
        (torch.nn.NLLLoss(), "y", True),
        (torch.nn.CrossEntropyLoss(), "probs", False),  # float targets = class probabilities
        (torch.nn.CrossEntropyLoss(), "k", False),  # int64 already
        (torch.nn.MSELoss(), "y", False),
        (torch.nn.BCEWithLogitsLoss(), "y", False),
    ],
)
def test_which_label_columns_are_class_indices(loss, label, cast):
    from spark_estimators.torch import indices

    found = indices.label_index_cols([loss], [label], COLUMNS)
    assert [c.name for c in found] == ([label] if cast else [])


def test_embedding_probe_finds_only_the_embedded_column_and_leaves_the_model_as_it_was():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(5, 3)
            self.fc = torch.nn.Linear(5, 1)

        def forward(self, idx, x):
            return self.fc(torch.cat([self.emb(idx), x], dim=1))

    from spark_estimators.torch import indices

    model = Model().train()
    found = indices.embedding_index_cols(model, ["idx", "x"], COLUMNS, None)
    assert [c.name for c in found] == ["idx"]
    assert "emb" in found[0].reason
    assert model.training and model.emb.training and not model.emb._forward_pre_hooks


def test_converter_casts_index_columns_and_refuses_fractions():
    convert = BatchConverter(["idx", "x"], ["y"], index_cols=("idx", "y"), to_torch=True)
    out = convert({"idx": np.array([0.0, 2.0]), "x": np.ones((2, 2)), "y": np.array([1.0, 0.0])})
    assert out["idx"].dtype == torch.int64 and out["idx"].shape == (2, 1)
    assert out["y"].dtype == torch.int64 and out["y"].tolist() == [1, 0]
    assert out["x"].dtype == torch.float32
    with pytest.raises(ValueError, match="column 'y'.*0.5"):
        convert({"idx": np.array([0.0, 2.0]), "x": np.ones((2, 2)), "y": np.array([0.5, 0.0])})
