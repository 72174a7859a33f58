"""End-to-end Keras training: KerasEstimator.fit vs a spark-tensorflow-distributor style run.

Usage:
    .venv/bin/python bench/fit_keras.py               # 100k x 10, MLP 10-64-64-1, Adam, 2 epochs
    .venv/bin/python bench/fit_keras.py --rows 20000  # smaller
    (one run of each side per process; repeat by running the script again)

Both sides start from the same cached DataFrame on local[2], 2 processes, batch 256 per
process, Adam(1e-3) unscaled, the same initial weights.

Baseline: what spark-tensorflow-distributor's ``MirroredStrategyRunner(num_slots=2,
local_mode=False)`` does (the package is not installed here; its mechanism is reproduced in
``_distributor_task``): the DataFrame is written to Parquet, a barrier Spark job starts one task
per slot, the tasks exchange host:port through ``BarrierTaskContext.allGather`` and set
``TF_CONFIG``, and each runs the training function in its Python worker under
``tf.distribute.MultiWorkerMirroredStrategy`` with a custom loop (Keras 3 ``fit`` under MWMS is
broken upstream): shard of the Parquet files -> ``tf.data`` -> ``strategy.run`` of a
GradientTape step whose gradients the strategy all-reduces. Both sides give each process the
same share of the cores (``intra_op = cores / 2``).

Reported: total wall time from the call to its return, time to the first training batch, last
epoch loss. Horovod 0.28.1 on this machine (TorchEstimator preset, not re-runnable here): 22-34 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH = 256
HIDDEN = [64, 64]
LR = 1e-3


def build_mlp(n_in: int, seed: int = 0) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    layers: list[Any] = [keras.Input((n_in,))]
    layers += [keras.layers.Dense(h, activation="relu") for h in HIDDEN]
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _distributor_task(path: str, n_features: int, epochs: int, weights: list[Any]) -> Any:
    """One barrier task of the MirroredStrategyRunner-style job (runs in the Python worker)."""

    def run(_: Any) -> Any:
        import glob

        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.split(":")[0]
        addresses = ctx.allGather(f"{host}:{_free_port()}")
        os.environ["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
        )
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import numpy as np
        import pyarrow.parquet as pq
        import tensorflow as tf

        world = len(addresses)
        threads = max(1, (os.cpu_count() or 1) // world)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        files = sorted(glob.glob(os.path.join(path, "*.parquet")))[rank::world]
        table = pq.read_table(files)
        x = np.stack([table.column(f"f{i}").to_numpy() for i in range(n_features)], axis=1)
        y = table.column("y").to_numpy().reshape(-1, 1)
        ds = tf.data.Dataset.from_tensor_slices((x.astype("float32"), y.astype("float32")))
        ds = ds.shuffle(10_000, seed=rank).batch(BATCH, drop_remainder=True).prefetch(2)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
        # Equal steps on every worker, or the collective hangs: the smallest shard decides.
        steps = min(int(n) for n in ctx.allGather(str(len(x) // BATCH)))
        with strategy.scope():
            import keras

            model = build_mlp(n_features)
            model.set_weights(weights)
            optimizer = keras.optimizers.Adam(LR)
        dist_ds = strategy.experimental_distribute_dataset(ds)

        # No annotations in the traced functions: autograph resolves them at conversion time.
        @tf.function
        def step(batch):  # type: ignore[no-untyped-def]
            def replica_step(xb, yb):  # type: ignore[no-untyped-def]
                with tf.GradientTape() as tape:
                    pred = model(xb, training=True)
                    per_row = tf.reduce_mean(tf.square(pred - yb), axis=-1)
                    loss = tf.nn.compute_average_loss(per_row, global_batch_size=BATCH * world)
                grads = tape.gradient(loss, model.trainable_variables)
                # Keras 3's TF optimizer all-reduces (sums) in the replica context itself.
                optimizer.apply(grads, model.trainable_variables)
                return loss

            per_replica = strategy.run(replica_step, args=batch)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        first = None
        loss = float("nan")
        for _ in range(epochs):
            it = iter(dist_ds)
            total = 0.0
            for _s in range(steps):
                total += float(step(next(it)))
                if first is None:
                    first = time.time()
            loss = total / steps
        yield {"rank": rank, "first_batch": first, "loss": loss}

    return run


def run_distributor(spark: Any, df: Any, n_features: int, epochs: int, weights: list[Any]) -> dict:
    path = tempfile.mkdtemp(prefix="bench-mwms-")
    try:
        t0 = time.time()
        df.repartition(2).write.mode("overwrite").parquet(path)
        rdd = spark.sparkContext.parallelize(range(2), 2).barrier()
        out = rdd.mapPartitions(_distributor_task(path, n_features, epochs, weights)).collect()
        total = time.time() - t0
        rank0 = next(r for r in out if r["rank"] == 0)
        return {
            "total_s": total,
            "first_batch_s": rank0["first_batch"] - t0,
            "loss": rank0["loss"],
        }
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_ours(vdf: Any, n_features: int, epochs: int) -> dict:
    import keras

    from spark_estimators.core.backend import SparkBackend
    from spark_estimators.keras import KerasEstimator
    from spark_estimators.store import LocalStore

    marks: dict[str, float] = {}

    class Timed(SparkBackend):
        def run(self, fn, args=(), kwargs=None, env=None, event_callback=None):  # type: ignore[override]
            def both(rank: int, kind: str, data: Any) -> None:
                if kind == "first_batch":
                    marks.setdefault("first_batch", float(data))
                if event_callback is not None:
                    event_callback(rank, kind, data)

            return super().run(fn, args, kwargs, env, both)

    tmp = tempfile.mkdtemp(prefix="bench-fit-keras-")
    try:
        est = KerasEstimator(
            backend=Timed(num_proc=2, verbose=0),
            store=LocalStore(tmp),
            model=build_mlp(n_features),
            optimizer=keras.optimizers.Adam(LR),
            loss="mse",
            feature_cols=["features"],
            label_cols=["y"],
            batch_size=BATCH,
            epochs=epochs,
            verbose=0,
            scale_lr=False,
        )
        t0 = time.time()
        fitted = est.fit(vdf)
        total = time.time() - t0
        return {
            "total_s": total,
            "first_batch_s": marks.get("first_batch", float("nan")) - t0,
            "loss": fitted.getHistory()[-1]["loss"],
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    nf = args.features
    cols = [F.rand(seed=i).alias(f"f{i}") for i in range(nf)]
    df = spark.range(args.rows, numPartitions=2).select(*cols)
    df = df.withColumn("y", sum(F.col(f"f{i}") * (i + 1) for i in range(nf)) / nf).cache()
    df.count()
    vdf = VectorAssembler(inputCols=[f"f{i}" for i in range(nf)], outputCol="features")
    vdf = vdf.transform(df).select("features", "y").cache()
    vdf.count()
    weights = build_mlp(nf).get_weights()

    # One run of each side per process: TensorFlow's collective ops can be configured once per
    # process, and the baseline runs in the (reused) Python workers. Repeat by re-running.
    results = {
        "spark_estimators KerasEstimator": run_ours(vdf, nf, args.epochs),
        "MWMS (distributor)": run_distributor(spark, df, nf, args.epochs, weights),
    }

    print(f"{args.rows} rows x {nf} features, MLP {nf}-64-64-1, Adam, {args.epochs} epochs,")
    print(f"batch {BATCH} per process, 2 processes, local[2]")
    print(f"{'case':34s} {'total s':>8s} {'first batch s':>14s} {'last loss':>10s}")
    for name, r in results.items():
        print(f"{name:34s} {r['total_s']:8.2f} {r['first_batch_s']:14.2f} {r['loss']:10.4f}")
    ours = results["spark_estimators KerasEstimator"]["total_s"]
    mwms = results["MWMS (distributor)"]["total_s"]
    print(f"ours / MWMS distributor = {ours / mwms:.3f}")
    print(f"ours / horovod (22-34 s measured here) = {ours / 34:.3f} .. {ours / 22:.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
