"""Run in its own process: issue 25's Spark Connect checks (items 12 and 13).

Starts a real local Spark Connect server (``SparkSession.builder.remote("local[1]")``) and
prints ``RESULT <json>``:

- ``overwrite``: ``write().overwrite().save(path)`` of a stage, twice, then what loads back
  (pyspark's ``MLWriter._handleOverwrite`` needs ``_jsparkSession``, which Connect lacks);
- ``cache``: prepare_data's dataset index for two equal VectorAssembler pipelines, one with
  other input columns, and the semantic hashes Spark gives the two equal ones.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark.sql import SparkSession  # noqa: E402


def overwrite_step(tmp: str) -> dict:
    import torch

    from spark_estimators.torch import TorchEstimator

    path = os.path.join(tmp, "estimator")
    model = torch.nn.Linear(2, 1)
    loaded = []
    for epochs in (3, 5):
        est = TorchEstimator(
            model=model, loss=torch.nn.MSELoss(), feature_cols=["features"], epochs=epochs
        )
        est.write().overwrite().save(path)
        loaded.append(TorchEstimator.load(path).getEpochs())
    return {"loaded_epochs": loaded}


def cache_step(spark, tmp: str) -> dict:
    from pyspark.ml.feature import VectorAssembler

    from spark_estimators.data import prepare_data
    from spark_estimators.store import LocalStore

    source = os.path.join(tmp, "source")
    rows = [(float(i), float(i % 7), float(i % 3), float(i % 2)) for i in range(40)]
    spark.createDataFrame(rows, ["a", "b", "c", "y"]).write.parquet(source)

    def assembled(cols):
        df = spark.read.parquet(source)
        return VectorAssembler(inputCols=cols, outputCol="features").transform(df)

    store = LocalStore(os.path.join(tmp, "store"))
    first = prepare_data(2, store, assembled(["a", "b"]), ["features"], ["y"])
    again = prepare_data(2, store, assembled(["a", "b"]), ["features"], ["y"])
    other = prepare_data(2, store, assembled(["a", "c"]), ["features"], ["y"])
    plain = [
        prepare_data(2, store, spark.read.parquet(source).filter("a > 3"), ["a"], ["y"])
        for _ in range(2)
    ]
    return {
        "plain": [meta.dataset_idx for meta in plain],
        "semantic_hashes": [assembled(["a", "b"]).semanticHash() for _ in range(2)],
        "first": first.dataset_idx,
        "again": again.dataset_idx,
        "other": other.dataset_idx,
        "datasets": store.list_datasets(),
        "rows": first.train_rows + first.val_rows,
    }


def main() -> None:
    spark = SparkSession.builder.remote("local[1]").getOrCreate()
    out: dict = {"session": type(spark).__module__}
    try:
        with tempfile.TemporaryDirectory(prefix="se-connect25-") as tmp:
            for name, step in (
                ("overwrite", lambda: overwrite_step(tmp)),
                ("cache", lambda: cache_step(spark, tmp)),
            ):
                try:
                    out[name] = step()
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        spark.stop()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
