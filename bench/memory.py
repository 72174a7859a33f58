"""Rank memory vs data size: peak RSS of one epoch of our reader at 100k, 1M and 5M rows.

Usage: .venv/bin/python bench/memory.py [--sizes 100000,1000000,5000000] [--data-dir DIR]
       [--num-proc 2] [--batch-size 256] [--epochs 1] [--no-torch]

Data: ``rows`` x 10 float64 features assembled into one ML vector (``VectorAssembler``, as
bench/fit.py's horovod preset) + a label, prepared with ``prepare_data(num_proc, ...)`` into
``DIR/rows-N`` (kept and reused when ``--data-dir`` is given: the Spark write runs once).

Per size, ``--num-proc`` fresh processes (one per rank, run side by side, as the ranks of a fit)
each read their shard for ``--epochs`` epochs with the settings an estimator uses
(``batch_size``, ``shuffle=True``, ``num_workers=2``, through ``torch_batches``) and report
``ru_maxrss`` (peak resident set), the RSS after the imports (torch, pyarrow; before reading), and
the reader's high-water mark of decoded rows held at once (``BatchReader.held_rows_peak``).
The target (issue 20): peak RSS at 5M within +15% of 100k. ``PYTHONPATH=OLD_TREE`` runs the
ranks on another checkout (a baseline in the same hour).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_FEATURES = 10


def prepare(data_dir: Path, rows: int, num_proc: int) -> Path:
    """Prepare (once) ``rows`` x 10 floats with Spark; return the store's root."""
    root = data_dir / f"rows-{rows}"
    if (root / ".prepared").exists():
        return root
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    from spark_estimators.core.session import create_local_session
    from spark_estimators.data import prepare_data
    from spark_estimators.store import LocalStore

    spark = create_local_session("local[2]", spark__driver__memory="2g")
    spark.sparkContext.setLogLevel("ERROR")
    cols = [F.rand(seed=i).alias(f"f{i}") for i in range(N_FEATURES)]
    df = spark.range(rows, numPartitions=4).select(*cols)
    df = df.withColumn("y", sum(F.col(f"f{i}") * (i + 1) for i in range(N_FEATURES)))
    inputs = [f"f{i}" for i in range(N_FEATURES)]
    assembler = VectorAssembler(inputCols=inputs, outputCol="features")
    t0 = time.perf_counter()
    meta = prepare_data(
        num_proc, LocalStore(str(root)), assembler.transform(df), ["features"], ["y"], verbose=0
    )
    print(
        f"prepared {rows} rows in {time.perf_counter() - t0:.1f} s: {len(meta.train_files)} "
        f"files, {meta.train_bytes / 1e6:.0f} MB, row groups {meta.train_files[0].row_groups[:3]}"
    )
    (root / ".prepared").touch()
    return root


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(root: str, rank: int, size: int, batch_size: int, epochs: int, use_torch: bool) -> None:
    """One rank: read ``epochs`` epochs and print a JSON line of memory figures."""
    import resource

    import pyarrow  # noqa: F401

    from spark_estimators.data import DatasetMetadata, make_batch_reader
    from spark_estimators.store import LocalStore

    if use_torch:
        import torch  # noqa: F401

        from spark_estimators.data import torch_batches
    store = LocalStore(root)
    meta = DatasetMetadata.load(store)
    after_imports = rss_mb()
    # An estimator's train settings; keywords (not ReaderOptions) so older trees run it too.
    reader = make_batch_reader(
        store, meta, rank=rank, size=size, batch_size=batch_size, shuffle=True, num_workers=2
    )
    rows = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        batches = torch_batches(reader) if use_torch else reader
        for batch in batches:
            rows += len(batch["y"])
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rank": rank,
                "rows": rows,
                "peak_rss_mb": peak,
                "after_imports_mb": after_imports,
                "held_rows_peak": getattr(reader, "held_rows_peak", None),
                "epoch_s": wall / epochs,
            }
        )
    )


def run_ranks(root: Path, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", str(root), "--num-proc", str(args.num_proc)]
    cmd += ["--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    if args.no_torch:
        cmd.append("--no-torch")
    # What the Spark task tells a rank: the ranks on this host (the reader sizes its read-ahead).
    env = {**os.environ, "SPARK_ESTIMATORS_LOCAL_SIZE": str(args.num_proc)}
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(args.num_proc)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"rank process failed ({p.returncode}): {stdout[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,5000000")
    parser.add_argument("--data-dir", default=None, help="keep prepared datasets here")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--no-torch", action="store_true", help="numpy batches, no torch import")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rank, args.num_proc, args.batch_size, args.epochs, not args.no_torch)
        return

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="bench-memory-"))
    sizes = [int(s) for s in args.sizes.split(",")]
    roots = {rows: prepare(data_dir, rows, args.num_proc) for rows in sizes}
    print(
        f"nproc {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, {args.num_proc} ranks, "
        f"batch {args.batch_size}, {args.epochs} epoch(s), torch={not args.no_torch}"
    )
    print(
        f"{'rows':>9s} {'rank':>4s} {'peak RSS MB':>11s} {'x 100k':>7s} {'imports MB':>10s} "
        f"{'reading MB':>10s} {'held rows':>9s} {'epoch s':>7s}"
    )
    base: dict[int, float] = {}
    for rows in sizes:
        for r in run_ranks(roots[rows], args):
            base.setdefault(r["rank"], r["peak_rss_mb"])
            print(
                f"{rows:>9d} {r['rank']:>4d} {r['peak_rss_mb']:>11.0f} "
                f"{r['peak_rss_mb'] / base[r['rank']]:>7.2f} {r['after_imports_mb']:>10.0f} "
                f"{r['peak_rss_mb'] - r['after_imports_mb']:>10.0f} {r['held_rows_peak']!s:>9s} "
                f"{r['epoch_s']:>7.2f}"
            )
    if not args.data_dir:
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
