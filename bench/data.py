"""Data path: prepare_data vs df.write.parquet, and reader rows/s vs raw pyarrow (and petastorm).

Usage: .venv/bin/python bench/data.py [--rows 1000000] [--batch-size 256] [--repeats 3]
       [--layout array|scalars] [--store DIR] [--skip-write]
       python bench/data.py --read-only --store DIR   (no Spark: reader comparison on DIR's dataset)

``--store DIR`` keeps the prepared dataset there. ``--read-only`` compares the readers on it without
Spark, e.g. in the petastorm environment (requirements-petastorm.txt + torch), so petastorm runs in
the same process as the raw scan and our reader.

Dataset: ``rows`` x 32 float32 features + a float32 label, cached in Spark memory first so both
writers measure shuffle + write only. ``--layout array`` (default) keeps the features in one
``array<float>`` column (what VectorAssembler users get, one tensor per batch); ``scalars`` uses 32
float columns (our reader then stacks them with ``stack_columns``).

1. Write: ``prepare_data(2, ...)`` (fresh store each time, so never a cache hit) vs
   ``df.repartition(n).write.parquet`` with the same ``n`` (same shuffle). Median of repeats,
   alternating order. Target: ratio <= 1.15.
2. Read, one process reading the whole prepared train set (rank 0 of 1), page cache warm:
   - raw: ``pyarrow.dataset`` scan -> numpy arrays per record batch (the limit: no batching);
   - ours: ``torch_batches(make_batch_reader(...))``, batches of ``--batch-size`` as torch tensors,
     without and with shuffle (2 decode threads, the default; and 1), and from the in-memory
     cache (second epoch); the reader is built inside the timed call;
   - petastorm ``make_batch_reader`` + ``BatchedDataLoader`` when petastorm is importable.
   Rounds alternate the cases; medians of rows/s, time to first batch and CPU time per row (all
   threads) are printed with the load average, and ours / raw per round. Targets: ours (no
   shuffle) >= 0.8x raw on an idle machine, >= 1.4x under load, >= 3x petastorm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from spark_estimators.data import DatasetMetadata, make_batch_reader, prepare_data, torch_batches
from spark_estimators.store import LocalStore

N_FEATURES = 32
RAW = "raw pyarrow.dataset -> numpy"
OURS = "ours, torch, no shuffle"
PETASTORM = "petastorm make_batch_reader + BatchedDataLoader"


def make_df(spark, rows: int, layout: str):
    from pyspark.sql import functions as F

    base = spark.range(rows, numPartitions=4)
    cols = [F.rand(seed=i).cast("float").alias(f"f{i}") for i in range(N_FEATURES)]
    label = F.rand(seed=99).cast("float").alias("label")
    if layout == "array":
        df = base.select(F.array(*cols).alias("features"), label)
        features = ["features"]
    else:
        df = base.select(*cols, label)
        features = [f"f{i}" for i in range(N_FEATURES)]
    df = df.cache()
    df.count()
    return df, features


def bench_write(spark, df, features, repeats: int, ppp: int | None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"prepare_data": [], "repartition+write.parquet": []}
    parts: list[int] = []
    root = tempfile.mkdtemp(prefix="bench-data-")

    def ours(k: int) -> None:
        store = LocalStore(f"{root}/store-{k}")
        t0 = time.perf_counter()
        meta = prepare_data(
            2, store, df, features, ["label"], partitions_per_process=ppp, verbose=0
        )
        times["prepare_data"].append(time.perf_counter() - t0)
        parts.append(int(meta.params["partitions"]))

    def plain(k: int) -> None:
        n = parts[-1] if parts else 2 * (ppp or 1)
        t0 = time.perf_counter()
        df.repartition(n).write.mode("overwrite").parquet(f"{root}/plain-{k}")
        times["repartition+write.parquet"].append(time.perf_counter() - t0)

    ours(-1)  # warm-up (Python workers, JIT of the plan) and the partition count for plain
    plain(-1)
    for name in times:
        times[name].clear()
    for k in range(repeats):
        first, second = (ours, plain) if k % 2 == 0 else (plain, ours)
        first(k)
        second(k)
    shutil.rmtree(root, ignore_errors=True)
    print(f"partitions: {parts[-1]}")
    return times


@dataclass
class ReadStats:
    """Per case: rows/s, time to first batch and CPU time per row (all threads) of each round."""

    rows_per_s: list[float] = field(default_factory=list)
    first_batch_s: list[float] = field(default_factory=list)
    cpu_ns_per_row: list[float] = field(default_factory=list)


def read_rounds(
    cases: dict[str, Callable[[], Iterable[int]]], repeats: int
) -> dict[str, ReadStats]:
    """Rounds that interleave the cases (load noise hits all alike); medians are reported.

    A case yields the rows of each batch; the clock runs from the call (reader built, scan
    started) to the last batch, and ``first_batch_s`` to the first one.
    """
    stats = {name: ReadStats() for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            first = None
            n = 0
            for rows in fn():
                if first is None:
                    first = time.perf_counter() - t0
                n += rows
            wall = time.perf_counter() - t0
            stats[name].rows_per_s.append(n / wall)
            stats[name].first_batch_s.append(first or 0.0)
            stats[name].cpu_ns_per_row.append((time.process_time() - c0) / n * 1e9)
    return stats


def bench_read(store, meta, features, batch_size: int, repeats: int) -> dict[str, float]:
    import pyarrow.dataset as pads

    files = [f.path for f in meta.train_files]
    cols = [*features, "label"]
    stack = {"features": features} if len(features) > 1 else None

    def raw() -> Iterator[int]:
        for rb in pads.dataset(files, format="parquet").to_batches(columns=cols):
            arrays = {}
            for name in cols:
                col = rb.column(name)
                if name == "features" and stack is None:
                    arrays[name] = col.flatten().to_numpy().reshape(len(rb), N_FEATURES)
                else:
                    arrays[name] = col.to_numpy()
            yield len(arrays["label"])

    def ours(shuffle: bool, cache: bool = False, workers: int = 2):
        def make():
            # Keywords, not ReaderOptions: the bench also runs against older trees (baselines).
            return make_batch_reader(
                store,
                meta,
                rank=0,
                size=1,
                batch_size=batch_size,
                shuffle=shuffle,
                inmemory_cache=cache,
                stack_columns=stack,
                num_workers=workers,
            )

        if cache:
            reader = make()
            for _ in torch_batches(reader):  # the first epoch fills the cache
                pass
            return lambda: (len(b["label"]) for b in torch_batches(reader))
        return lambda: (len(b["label"]) for b in torch_batches(make()))

    sum(raw())  # page cache warm
    import torch  # noqa: F401  (imported before timing: the adapter imports it lazily)

    cases = {
        RAW: raw,
        OURS: ours(False),
        "ours, torch, no shuffle, 1 worker": ours(False, workers=1),
        "ours, torch, shuffle": ours(True),
        "ours, torch, shuffle, in-memory cache": ours(True, cache=True),
    }
    try:
        from petastorm import make_batch_reader as petastorm_reader
        from petastorm.pytorch import BatchedDataLoader
    except ImportError:
        print("petastorm: not importable here (needs pyarrow 14 / numpy<2), skipped")
    else:

        def petastorm() -> Iterator[int]:
            urls = ["file://" + f for f in files]
            with petastorm_reader(urls, num_epochs=1, schema_fields=cols) as reader:
                for b in BatchedDataLoader(reader, batch_size=batch_size):
                    yield len(b["label"])

        cases[PETASTORM] = petastorm
    return read_rounds(cases, repeats)


def report_read(stats: dict[str, ReadStats]) -> None:
    med = {k: statistics.median(v.rows_per_s) for k, v in stats.items()}
    raw = med[RAW]
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians of rounds")
    head = f"{'M rows/s':>8s} {'x raw':>6s} {'first batch ms':>14s} {'CPU ns/row':>10s}"
    print(f"  {'case':50s} {head}")
    for name, st in stats.items():
        first = statistics.median(st.first_batch_s) * 1e3
        cpu = statistics.median(st.cpu_ns_per_row)
        speed = f"{med[name] / 1e6:8.2f} {med[name] / raw:6.2f}"
        print(f"  {name:50s} {speed} {first:14.1f} {cpu:10.0f}")
    ours = med[OURS]
    print(f"  ours / raw = {ours / raw:.2f}x (target >= 0.8 idle, >= 1.4 under load)")
    paired = [o / r for o, r in zip(stats[OURS].rows_per_s, stats[RAW].rows_per_s, strict=True)]
    print(f"  ours / raw per round: {', '.join(f'{x:.2f}' for x in paired)}")
    peta = med.get(PETASTORM)
    if peta:
        print(f"  ours / petastorm = {ours / peta:.2f}x (target >= 3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=["array", "scalars"], default="array")
    parser.add_argument("--partitions-per-process", type=int, default=None)
    parser.add_argument("--skip-write", action="store_true", help="only the reader comparison")
    parser.add_argument("--store", default=None, help="keep (or, with --read-only, find) data here")
    parser.add_argument("--read-only", action="store_true", help="readers only, on --store")
    args = parser.parse_args()

    if args.read_only:
        if not args.store:
            parser.error("--read-only needs --store DIR (a store prepared by an earlier run)")
        store = LocalStore(args.store)
        meta = DatasetMetadata.load(store)
        print(f"read-only: {meta.train_rows} rows from {args.store}, batch_size={args.batch_size}")
        report_read(bench_read(store, meta, meta.feature_cols, args.batch_size, args.repeats))
        return

    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]", spark__driver__memory="4g")
    spark.sparkContext.setLogLevel("ERROR")
    df, features = make_df(spark, args.rows, args.layout)
    print(f"rows={args.rows} layout={args.layout} batch_size={args.batch_size}")

    if not args.skip_write:
        times = bench_write(spark, df, features, args.repeats, args.partitions_per_process)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, values in times.items():
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {name:28s} median {med[name]:6.2f} s  ({shown})")
        ratio = med["prepare_data"] / med["repartition+write.parquet"]
        print(f"  prepare_data / write.parquet = {ratio:.2f}x (target <= 1.15)")

    root = args.store or tempfile.mkdtemp(prefix="bench-read-")
    store = LocalStore(root)
    meta = prepare_data(2, store, df, features, ["label"], verbose=0)
    print(
        f"prepared: {len(meta.train_files)} files, {meta.train_bytes / 1e6:.0f} MB, "
        f"row groups per file {meta.train_files[0].row_groups}"
    )
    spark.stop()
    report_read(bench_read(store, meta, features, args.batch_size, args.repeats))
    if not args.store:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
