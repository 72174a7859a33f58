"""``make demo``: fit a TorchEstimator on an embedded local[2] SparkSession.

Run with ``python -m spark_estimators.demo``: builds a synthetic regression DataFrame, fits an
MLP with 2 training processes and a validation split, prints each epoch's metrics once (live),
then the fit's time and its first and last losses, transforms a held-out test set and prints its
R^2.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import numpy as np


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    return float(1.0 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2))


def main() -> None:
    """Run the demo on an embedded local session."""
    from spark_estimators.core.session import create_local_session
    from spark_estimators.store import LocalStore

    # The store (prepared data, checkpoints) is this run's scratch: removed when the demo ends.
    with tempfile.TemporaryDirectory(prefix="spark_estimators-demo-") as store_dir:
        spark = create_local_session("local[2]")
        try:
            _fit_and_report(spark, LocalStore(store_dir))
        finally:
            spark.stop()


def _fit_and_report(spark: Any, store: Any, n_rows: int = 20_000, epochs: int = 6) -> None:
    import torch
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from spark_estimators.torch import TorchEstimator

    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(7)
    n, d = n_rows, 8
    x = rng.normal(size=(n, d)).astype(np.float64)
    w = rng.normal(size=d)
    y = np.tanh(x @ w) * 2.0 + 0.3 * x[:, 0] ** 2 + rng.normal(scale=0.05, size=n)
    pdf = {"f": list(x), "y": y}
    import pandas as pd

    df = spark.createDataFrame(pd.DataFrame(pdf)).select(
        array_to_vector(F.col("f")).alias("features"), F.col("y")
    )
    train_df, test_df = df.randomSplit([0.9, 0.1], seed=1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    estimator = TorchEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=2e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        validation=0.1,
        batch_size=128,
        epochs=epochs,
        random_seed=1,
        verbose=1,
    )
    t0 = time.perf_counter()
    fitted = estimator.fit(train_df)
    fit_s = time.perf_counter() - t0
    rows = fitted.transform(test_df).select("y", "y__output").collect()
    y_true = np.array([r["y"] for r in rows])
    y_pred = np.array([r["y__output"] for r in rows])
    print()
    print(f"TorchEstimator.fit on {spark.sparkContext.master} with 2 processes: {fit_s:.1f}s")
    # The epoch lines were printed live, once each (issue 41): here only first -> last.
    history = fitted.getHistory()
    for key in ("loss", "val_loss"):
        if history and key in history[0]:
            first, last = history[0][key], history[-1][key]
            print(f"  {key}: {first:.4g} -> {last:.4g} over {len(history)} epochs")
    print(f"test rows: {len(rows)}, R^2 = {_r2(y_true, y_pred):.3f}")


if __name__ == "__main__":
    main()
