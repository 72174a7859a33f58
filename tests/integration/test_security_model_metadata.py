"""Issue 27 item 12: the model key's HMAC covers the stage's metadata, not only stage.pkl.

Before the fix an edited featureCols/labelCols loaded silently with the key.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch")

from spark_estimators import envvars  # noqa: E402
from spark_estimators.core import persistence  # noqa: E402
from spark_estimators.errors import ModelIntegrityError, UnverifiedModelWarning  # noqa: E402
from spark_estimators.torch import TorchModel  # noqa: E402
from tests.integration.test_model_integrity import (  # noqa: E402
    make_model,
    rewrite_metadata,
    same_weights,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

OLD_MODELS = os.path.join(os.path.dirname(__file__), "..", "data", "saved_before_issue19")


@pytest.fixture
def signed(tmp_path, monkeypatch, spark):
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "signed")
    make_model().save(path, key="s3cret")
    return path


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("featureCols", lambda meta: meta["paramMap"].__setitem__("featureCols", ["other"])),
        ("labelCols", lambda meta: meta["paramMap"].__setitem__("labelCols", ["z"])),
        ("a default", lambda meta: meta["defaultParamMap"].__setitem__("transformBatchSize", 1)),
        ("the class", lambda meta: meta.__setitem__("class", "pyspark.ml.Pipeline")),
    ],
)
def test_edited_metadata_is_refused_with_the_key(signed, field, edit):
    loaded = TorchModel.load(signed, key="s3cret")
    assert loaded.getFeatureCols() == ["features"] and same_weights(loaded)
    rewrite_metadata(signed, edit)
    with pytest.raises(ModelIntegrityError, match="metadata"):
        TorchModel.load(signed, key="s3cret")


def test_metadata_hmac_depends_on_the_key_and_the_content(signed):
    with open(_part(signed)) as f:
        record = json.loads(f.read())[persistence.DIGEST_KEY]
    assert len(record["metadataHmacSha256"]) == 64
    assert record["metadataHmacSha256"] != record["hmacSha256"]


def _part(path):
    (part,) = glob.glob(os.path.join(path, "metadata", "part-*"))
    return part


def test_model_signed_by_an_earlier_version_loads_with_a_warning(signed):
    # What an earlier version wrote: an HMAC of stage.pkl only.
    rewrite_metadata(signed, lambda meta: meta[persistence.DIGEST_KEY].pop("metadataHmacSha256"))
    with pytest.warns(UnverifiedModelWarning, match="not its metadata"):
        loaded = TorchModel.load(signed, key="s3cret")
    assert same_weights(loaded)


def test_models_saved_before_issue_19_still_load(tmp_path, spark, monkeypatch):
    pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "old")
    shutil.copytree(os.path.join(OLD_MODELS, "lightning_estimator"), path)
    with warnings.catch_warnings():  # a SHA-256-only stage loads, checked, without warnings
        warnings.simplefilter("error", UnverifiedModelWarning)
        est = LightningEstimator.load(path)
    assert est.getFeatureCols() == ["x"] and est.getLabelCols() == ["y"]
    assert est.getEpochs() == 3
