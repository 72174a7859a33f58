"""pyspark.ml's CrossValidator over a TorchEstimator, as a user tunes one (issue 26).

The folds' fits run one after another (``parallelism=1``) or two at a time (``parallelism=2``):
each fit's barrier stage waits for its task slots, and every rank is forked from the executor's
zygote (task/spare.py). The grid is over ``epochs``: more epochs fit the linear data better, so
the validation RMSE tells the maps apart and the check could fail.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.evaluation import RegressionEvaluator  # noqa: E402
from pyspark.ml.feature import VectorAssembler  # noqa: E402
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402
from tests.conftest import rank_processes  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _data(spark):
    raw = spark.range(400, numPartitions=2).select(
        (F.col("id") % 17 / 17.0).alias("a"), (F.col("id") % 11 / 11.0).alias("b")
    )
    raw = raw.withColumn("y", 3.0 * F.col("a") - 2.0 * F.col("b") + 0.5)
    return VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(raw)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_cross_validator_picks_the_map_that_fits_better(spark, tmp_path, parallelism):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    est = TorchEstimator(
        num_proc=2,
        store=LocalStore(str(tmp_path)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    grid = ParamGridBuilder().addGrid(est.getParam("epochs"), [1, 12]).build()
    evaluator = RegressionEvaluator(labelCol="y", predictionCol="y__output", metricName="rmse")
    cv = CrossValidator(
        estimator=est,
        estimatorParamMaps=grid,
        evaluator=evaluator,
        numFolds=2,
        seed=3,
        parallelism=parallelism,
    )
    df = _data(spark)
    cv_model = cv.fit(df)
    one_epoch, twelve_epochs = cv_model.avgMetrics
    assert twelve_epochs < one_epoch  # the longer fit wins on the held-out folds
    assert twelve_epochs < 0.2  # and learned the line (y spans about 5)
    rmse = evaluator.evaluate(cv_model.bestModel.transform(df))
    assert rmse == pytest.approx(twelve_epochs, abs=0.1)
    assert rank_processes() == []
