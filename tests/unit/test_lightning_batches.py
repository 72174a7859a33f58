"""Lightning batches are shaped by the rule TorchEstimator and transform() use (issue 19)."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spark_estimators.core import tensors  # noqa: E402
from spark_estimators.lightning.remote import converter  # noqa: E402


def BatchConverter(features, labels, weight, input_shapes, label_shapes):  # noqa: N802
    """The converter a Lightning rank builds from its spec."""
    fields = ("feature_cols", "label_cols", "sample_weight_col", "input_shapes", "label_shapes")
    values = (features, labels, weight, input_shapes, label_shapes)
    return converter(types.SimpleNamespace(**dict(zip(fields, values, strict=True))))


@pytest.mark.parametrize("shape", [[-1, 1, 4, 4], [1, 4, 4]], ids=["horovod-full", "per-row"])
def test_training_batches_have_the_shape_transform_feeds(shape):
    rng = np.random.default_rng(0)
    arrays = {"image": rng.normal(size=(8, 16)), "label": rng.integers(0, 3, size=8)}
    convert = BatchConverter(["image"], ["label"], None, [shape], None)
    batch = convert(arrays)
    (fed,) = tensors.model_inputs(arrays, ["image"], [shape])  # what transform() gives the model
    assert tuple(batch["image"].shape) == fed.shape == (8, 1, 4, 4)
    np.testing.assert_array_equal(batch["image"].numpy(), fed)
    assert tuple(batch["label"].shape) == (8,) and batch["label"].dtype == torch.int64


def test_sample_weights_and_unshaped_columns_keep_their_layout():
    arrays = {"x": np.arange(6.0).reshape(3, 2), "y": np.array([1.0, 2.0, 3.0]), "w": np.ones(3)}
    batch = BatchConverter(["x"], ["y"], "w", None, None)(arrays)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {"x": (3, 2), "y": (3,), "w": (3,)}
    assert batch["x"].dtype == torch.float32
