"""Saved models are verified before they are unpickled (issue 18, trust boundary).

A planted ``stage.pkl`` (an object whose ``__reduce__`` creates a marker file) must be refused
with ModelIntegrityError and the marker must not exist; an untouched model round-trips.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pickle
import warnings

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyspark.ml import PipelineModel  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators import envvars  # noqa: E402
from spark_estimators.core import persistence  # noqa: E402
from spark_estimators.errors import (  # noqa: E402
    ModelIntegrityError,
    NoModelKeyWarning,
    UnverifiedModelWarning,
)
from spark_estimators.torch import TorchEstimator, TorchModel  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


class Planted:
    """Unpickling this creates ``marker``: what an attacker's payload would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def make_model() -> TorchModel:
    torch.manual_seed(0)
    return TorchModel(
        model=torch.nn.Linear(2, 1),
        history=[{"epoch": 0, "loss": 1.5}],
        run_id="r1",
        output_shapes=[(1,)],
        featureCols=["features"],
        labelCols=["y"],
    )


@pytest.fixture(scope="module")
def df(spark):
    rows = [(Vectors.dense([float(i), float(-i) / 2]), float(i)) for i in range(8)]
    return spark.createDataFrame(rows, ["features", "y"])


def predictions(model: TorchModel, df) -> np.ndarray:
    rows = model.transform(df).orderBy("y").collect()
    return np.array([r["y__output"] for r in rows]).ravel()


def same_weights(loaded: TorchModel) -> bool:
    want = make_model().getModel().state_dict()
    got = loaded.getModel().state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def metadata_file(path: str) -> str:
    (part,) = glob.glob(os.path.join(path, "metadata", "part-*"))
    return part


def rewrite_metadata(path: str, change) -> None:
    """Edit the stage's Spark metadata JSON the way someone with write access to it could."""
    part = metadata_file(path)
    with open(part) as f:
        meta = json.loads(f.read())
    change(meta)
    with open(part, "w") as f:
        f.write(json.dumps(meta) + "\n")
    for crc in glob.glob(os.path.join(path, "metadata", ".*.crc")):
        os.remove(crc)  # Hadoop's local checksums would flag the edit before we could


def plant(path: str, marker: str) -> bytes:
    """Replace stage.pkl with a payload that runs code when unpickled; returns its bytes."""
    blob = cloudpickle.dumps({"params": {}, "extra": {"model": Planted(marker)}})
    with open(os.path.join(path, persistence.BLOB_NAME), "wb") as f:
        f.write(blob)
    return blob


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "model")
    make_model().save(path)
    return path


def test_round_trip_records_the_digest_and_predicts_the_same(saved, df):
    with open(os.path.join(saved, persistence.BLOB_NAME), "rb") as f:
        blob = f.read()
    with open(metadata_file(saved)) as f:
        record = json.loads(f.read())[persistence.DIGEST_KEY]
    assert record == {"file": "stage.pkl", "sha256": hashlib.sha256(blob).hexdigest()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedModelWarning)
        loaded = TorchModel.load(saved)
    x = torch.tensor([[float(i), float(-i) / 2] for i in range(8)])
    with torch.no_grad():
        want = make_model().getModel()(x).numpy().ravel()
    np.testing.assert_allclose(predictions(loaded, df), want, rtol=1e-6)
    assert same_weights(loaded)
    assert loaded.getHistory() == [{"epoch": 0, "loss": 1.5}]


def test_planted_stage_pickle_is_refused_before_it_runs(saved, tmp_path):
    marker = tmp_path / "pwned"
    blob = plant(saved, str(marker))
    with pytest.raises(ModelIntegrityError, match=r"stage\.pkl.*SHA-256.*not unpickled") as info:
        TorchModel.load(saved)
    assert not marker.exists(), "the planted payload ran"
    err = info.value
    assert err.path.endswith("stage.pkl")
    assert err.found == hashlib.sha256(blob).hexdigest() != err.expected
    # The error crosses processes with its fields.
    again = pickle.loads(pickle.dumps(err))
    assert (again.path, again.expected, again.found, str(again)) == (
        err.path,
        err.expected,
        err.found,
        str(err),
    )


def test_planted_stage_inside_a_pipeline_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "pipe")
    PipelineModel([make_model()]).save(path)
    (stage,) = glob.glob(os.path.join(path, "stages", "*"))
    marker = tmp_path / "pwned"
    plant(stage, str(marker))
    with pytest.raises(ModelIntegrityError):
        PipelineModel.load(path)
    assert not marker.exists()


def test_planted_estimator_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "est")
    model = torch.nn.Linear(2, 1)
    TorchEstimator(model=model, loss=torch.nn.MSELoss(), feature_cols=["f"], label_cols=["y"]).save(
        path
    )
    marker = tmp_path / "pwned"
    plant(path, str(marker))
    with pytest.raises(ModelIntegrityError):
        TorchEstimator.load(path)
    assert not marker.exists()


def test_model_saved_without_a_digest_loads_with_a_warning(saved):
    rewrite_metadata(saved, lambda meta: meta.pop(persistence.DIGEST_KEY))
    with pytest.warns(UnverifiedModelWarning, match="no integrity record"):
        loaded = TorchModel.load(saved)
    assert same_weights(loaded)


def test_key_signs_and_a_rewritten_digest_is_still_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "signed")
    make_model().save(path, key="s3cret")
    loaded = TorchModel.load(path, key="s3cret")
    assert same_weights(loaded)
    with pytest.raises(ModelIntegrityError, match="does not match"):
        TorchModel.load(path, key="other")

    # An attacker who can write the whole directory plants a payload and fixes the digest.
    marker = tmp_path / "pwned"
    blob = plant(path, str(marker))

    def forge(meta):
        meta[persistence.DIGEST_KEY]["sha256"] = hashlib.sha256(blob).hexdigest()

    rewrite_metadata(path, forge)
    with pytest.raises(ModelIntegrityError, match="HMAC"):
        TorchModel.load(path, key="s3cret")
    # ... or strips the signature: a configured key (here from the environment) refuses that too.
    rewrite_metadata(path, lambda meta: meta[persistence.DIGEST_KEY].pop("hmacSha256"))
    monkeypatch.setenv(envvars.MODEL_KEY, "s3cret")
    with pytest.raises(ModelIntegrityError, match="carries no HMAC"):
        TorchModel.load(path)
    rewrite_metadata(path, lambda meta: meta.pop(persistence.DIGEST_KEY))
    with pytest.raises(ModelIntegrityError, match="saved without a signature"):
        TorchModel.load(path)
    assert not marker.exists()


def test_environment_key_signs_pipeline_stages(tmp_path, monkeypatch):
    monkeypatch.setenv(envvars.MODEL_KEY, "k1")
    path = str(tmp_path / "pipe")
    PipelineModel([make_model()]).save(path)
    (stage,) = glob.glob(os.path.join(path, "stages", "*"))
    with open(metadata_file(stage)) as f:
        assert "hmacSha256" in json.loads(f.read())[persistence.DIGEST_KEY]
    loaded = PipelineModel.load(path)
    assert same_weights(loaded.stages[0])
    monkeypatch.setenv(envvars.MODEL_KEY, "k2")
    with pytest.raises(ModelIntegrityError):
        PipelineModel.load(path)
    # Signed but loaded without a key: the digest is checked, and a warning says the HMAC was not.
    monkeypatch.delenv(envvars.MODEL_KEY)
    with pytest.warns(UnverifiedModelWarning, match="signed but no key"):
        PipelineModel.load(path)


def test_stripped_signature_and_rewritten_digest_are_flagged_without_a_key(
    spark, tmp_path, monkeypatch
):
    """Issue 40: nothing in the directory can prove a model was signed, so a keyless load warns.

    Whoever can rewrite the metadata can drop any record that the model was signed; a load
    without a key cannot tell the stripped model from an unsigned one, and says so each time.
    """
    monkeypatch.delenv(envvars.MODEL_KEY, raising=False)
    path = str(tmp_path / "signed")
    make_model().save(path, key="s3cret")
    blob = cloudpickle.dumps(
        {"params": {}, "extra": {**make_model()._extra_state(), "run_id": "forged"}}
    )
    with open(os.path.join(path, persistence.BLOB_NAME), "wb") as f:
        f.write(blob)

    def strip_and_forge(meta):
        meta[persistence.DIGEST_KEY] = {
            "file": "stage.pkl",
            "sha256": hashlib.sha256(blob).hexdigest(),
        }

    rewrite_metadata(path, strip_and_forge)
    with pytest.warns(
        NoModelKeyWarning, match=r"loaded without a model key .*SPARK_ESTIMATORS_MODEL_KEY"
    ) as seen:
        loaded = TorchModel.load(path)
    assert loaded.getRunId() == "forged"  # it did load: without a key it cannot be refused
    (warning,) = [w for w in seen if issubclass(w.category, NoModelKeyWarning)]
    assert "signature was removed and digest rewritten" in str(warning.message)
    # The key refuses the same directory.
    with pytest.raises(ModelIntegrityError, match="carries no HMAC"):
        TorchModel.load(path, key="s3cret")


def test_unsigned_model_loaded_without_a_key_warns_with_its_own_category(spark, saved):
    with pytest.warns(NoModelKeyWarning, match="loaded without a model key"):
        loaded = TorchModel.load(saved)
    assert same_weights(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=NoModelKeyWarning)  # the documented opt-out
        assert same_weights(TorchModel.load(saved))
