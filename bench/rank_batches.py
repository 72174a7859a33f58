"""Rank batches: converting in the training thread per batch vs in the reader's prefetch thread.

Usage: .venv/bin/python bench/rank_batches.py [--rows 200000] [--batch-size 256] [--repeats 5]
       [--step-ms 2]

No Spark: ``rows`` x 32 float32 features (one list column, shaped ``[-1, 1, 4, 8]``) + a float
label are written with pyarrow; one rank (rank 0 of 1) reads one epoch with shuffling, as a
TorchEstimator rank does, and hands each batch to a stand-in training step (a torch matmul of
about ``--step-ms`` ms). Cases, alternating order, median wall time of ``--repeats`` epochs:

- before: the reader's numpy batches, each converted by the torch layout of
  :class:`~spark_estimators.core.batches.BatchConverter` in the training thread (what the torch
  rank did before issue 19);
- now: :func:`~spark_estimators.core.batches.epoch_batches`, which converts whole decoded blocks
  in the reader's prefetch thread; the training thread only slices.

Prints both medians and now / before (< 1 means the training thread waits less).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_estimators.core.batches import BatchConverter, epoch_batches
from spark_estimators.data import DatasetMetadata, make_batch_reader
from spark_estimators.store import LocalStore


def write_data(store: LocalStore, rows: int) -> DatasetMetadata:
    rng = np.random.default_rng(0)
    features = rng.random((rows, 32), dtype=np.float32)
    table = pa.table(
        {
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 32),
            "label": pa.array(rng.random(rows, dtype=np.float32)),
        }
    )
    path = store.get_train_data_path()
    store.makedirs(path)
    for k, lo in enumerate(range(0, rows, rows // 4)):
        part = table.slice(lo, rows // 4)
        pq.write_table(part, f"{path}/part-{k:03d}.parquet", row_group_size=10_000)
    return DatasetMetadata.from_parquet(
        store, path, feature_cols=["features"], label_cols=["label"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    weight = torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(20):
        weight @ weight
    matmuls = max(1, round(args.step_ms / ((time.perf_counter() - t0) / 20 * 1000)))

    def step(batch: dict) -> None:
        for _ in range(matmuls):
            weight @ weight
        assert batch["features"].shape[1:] == (1, 4, 8)

    store = LocalStore(tempfile.mkdtemp(prefix="bench-rank-batches-"))
    meta = write_data(store, args.rows)
    convert = BatchConverter(["features"], ["label"], input_shapes=[[-1, 1, 4, 8]])
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=args.batch_size)

    def before() -> None:
        for batch in reader:
            step(convert(batch))

    def now() -> None:
        for batch in epoch_batches(reader, convert):
            step(batch)

    cases = {"before (convert per batch, training thread)": before, "now (prefetch thread)": now}
    times: dict[str, list[float]] = {name: [] for name in cases}
    before(), now()  # warm-up: page cache, imports
    for k in range(args.repeats):
        order = list(cases) if k % 2 == 0 else list(reversed(cases))
        for name in order:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    steps = reader.steps_per_epoch
    print(f"{args.rows} rows, batch {args.batch_size}, {steps} steps, ~{args.step_ms} ms/step")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, value in medians.items():
        print(f"  {name:45s} {value:7.3f} s/epoch")
    ratio = (
        medians["now (prefetch thread)"] / medians["before (convert per batch, training thread)"]
    )
    print(f"  now / before = {ratio:.2f}x")


if __name__ == "__main__":
    main()
