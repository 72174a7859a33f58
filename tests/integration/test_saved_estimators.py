"""Estimators saved before issue 19 (which dropped Params from some of them) still load.

``tests/data/saved_before_issue19`` holds a LightningEstimator and a KerasEstimator saved by the
version before the change (commit 7004630): the Lightning one records ``optimizer``, ``loss``,
``metrics`` (set to None), ... and the Keras one ``lossConstructors``, Params they no longer have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pyspark.ml import Pipeline  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

SAVED = Path(__file__).resolve().parents[1] / "data" / "saved_before_issue19"


def test_an_old_lightning_estimator_loads_without_the_params_it_lost(spark):
    pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    est = LightningEstimator.load(str(SAVED / "lightning_estimator"))
    assert est.getFeatureCols() == ["x"]
    assert est.getLabelCols() == ["y"]
    assert est.getEpochs() == 3
    assert est.getBatchSize() == 8
    assert est.getScaleLr() is False
    assert not est.hasParam("loss")
    assert not est.hasParam("metrics")  # it was set (to None) in the old paramMap


def test_an_old_keras_estimator_loads_without_loss_constructors(spark):
    pytest.importorskip("keras")
    from spark_estimators.keras import KerasEstimator

    est = KerasEstimator.load(str(SAVED / "keras_estimator"))
    assert est.getEpochs() == 2
    assert est.getLoss() == "mse"
    assert est.getOptimizer() == "sgd"
    assert not est.hasParam("lossConstructors")


def test_an_old_stage_with_a_real_value_in_a_lost_param_is_refused(spark, tmp_path):
    pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    path = tmp_path / "lightning_estimator"
    shutil.copytree(SAVED / "lightning_estimator", path)
    meta_file = path / "metadata" / "part-00000"
    meta = json.loads(meta_file.read_text())
    meta["paramMap"]["lossWeights"] = [0.5]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(
        ConfigurationError, match=r"loss_weights= \(a list\) is not used by LightningEstimator"
    ):
        LightningEstimator.load(str(path))


def test_estimators_round_trip_through_a_pipeline(spark, tmp_path):
    pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator
    from spark_estimators.torch import TorchEstimator

    torch_est = TorchEstimator(feature_cols=["x"], label_cols=["y"], loss_weights=[0.5], epochs=4)
    lightning_est = LightningEstimator(feature_cols=["x"], label_cols=["y"], num_gpus=0)
    Pipeline(stages=[torch_est, lightning_est]).save(str(tmp_path / "pipe"))
    first, second = Pipeline.load(str(tmp_path / "pipe")).getStages()
    assert isinstance(first, TorchEstimator)
    assert first.getLossWeights() == [0.5]
    assert first.getEpochs() == 4
    assert isinstance(second, LightningEstimator)
    assert second.getNumGpus() == 0
    assert not second.hasParam("optimizer")
