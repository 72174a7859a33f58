"""prepare_data vs ``df.repartition(n).write.parquet`` of the same columns, same run.

Usage:
    .venv/bin/python bench/prepare.py --rounds 8
    .venv/bin/python bench/prepare.py --rows 5000000 --features 32 --no-cache --cases vector \
        --rounds 1   # the large preset's shape: us per row at 5M rows (issue 45)

The horovod preset's data (100k rows: 10 float features assembled into one ML vector column by
VectorAssembler, plus a float label; cached), written by ``prepare_data(2, ...)`` (a new store
each time, so nothing is cached) and by the DECISIONS baseline
``df.select(cols).repartition(n).write.parquet`` with the same ``n`` (the partitions prepare_data
chose), alternating which goes first. Also the 11 scalar columns without the assembler. Printed:
seconds and Spark jobs per case and round, medians and the ratio of medians (target <= 1.15x),
and microseconds per row. ``--features`` sets the number of float columns (32: the large preset),
``--no-cache`` recomputes the rows for every write (5M x 32 does not fit the driver's cache),
``--cases vector`` or ``scalars`` runs one of the two. ``--shuffled`` adds a third write per
round, prepare_data with the hash shuffle it used before issue 45 (``partitions_per_process=1``:
the frame's 2 partitions are not 1 per process, so it shuffles to 2), printed as "shuffled".

``--floors`` adds three same-run references that split a write's time (issue 45, session 4):
"frame" is the user's DataFrame itself, its selected columns drained by Spark's ``noop`` writer
(with ``--no-cache`` that is the 32 ``rand`` columns and the VectorAssembler: a cost any use of
the frame pays, not the write's); "handoff" is the frame as prepare_data converts it
(``vector_to_array``) sent through ``mapInArrow`` to a Python function that only counts the
rows: what Spark charges any Python writer before it encodes a byte; "native" is Spark's own
``write.parquet`` of those converted columns without a shuffle (no Python at all). Printed: each
one's us/row, and prepare_data's own cost per row, ``(prepare_data - frame) / rows``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any


def timed_jobs(spark: Any, fn: Any) -> tuple[float, int, Any]:
    sc = spark.sparkContext
    group = f"bench-{uuid.uuid4().hex}"
    sc.setJobGroup(group, group)
    try:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return seconds, len(sc.statusTracker().getJobIdsForGroup(group)), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--cases", default="vector,scalars")
    parser.add_argument("--shuffled", action="store_true")
    parser.add_argument("--floors", action="store_true")
    args = parser.parse_args()

    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    from spark_estimators.core.session import create_local_session
    from spark_estimators.data import prepare_data
    from spark_estimators.store import LocalStore

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    nf = args.features
    names = [f"f{i}" for i in range(nf)]
    df = spark.range(args.rows, numPartitions=2).select(
        *[F.rand(seed=i).alias(n) for i, n in enumerate(names)]
    )
    df = df.withColumn("y", sum(F.col(n) * (i + 1) for i, n in enumerate(names)) / nf)
    if not args.no_cache:
        df = df.cache()
        df.count()
    assembler = VectorAssembler(inputCols=names, outputCol="features")
    vdf = assembler.transform(df).select("features", "y")
    if not args.no_cache:
        vdf = vdf.cache()
        vdf.count()
    datasets = {"vector": (vdf, ["features"]), "scalars": (df, names)}
    datasets = {k: datasets[k] for k in args.cases.split(",")}
    print(
        f"{args.rows} rows x {nf} features, prepare_data(2, ...) vs repartition(n).write.parquet, "
        f"local[2], {'not ' if args.no_cache else ''}cached"
    )
    print("load average at start:", os.getloadavg())
    times: dict[str, list[float]] = {}
    parts: dict[str, int] = {}

    def ours(frame: Any, features: list[str], tmp: str, ppp: int | None = None) -> Any:
        store = LocalStore(os.path.join(tmp, "store"))
        return prepare_data(2, store, frame, features, ["y"], verbose=0, partitions_per_process=ppp)

    def base(frame: Any, features: list[str], tmp: str, n: int) -> Any:
        return frame.select(*features, "y").repartition(n).write.parquet(os.path.join(tmp, "b"))

    def converted(frame: Any, features: list[str]) -> Any:
        """The columns as prepare_data hands them to its writer (no shuffle, vectors as arrays)."""
        from spark_estimators.data.columns import describe_columns, kind_of, training_frame

        used = [*features, "y"]
        kinds = {c: kind_of(frame, c) for c in used}
        columns = describe_columns(frame, used, kinds, False, None)
        return training_frame(frame, columns, None, 0.0, 42, None, by_content=True)[0]

    floors = {label: converted(frame, features) for label, (frame, features) in datasets.items()}

    def floor_case(name: str, label: str, tmp: str) -> Any:
        frame, features = datasets[label]
        if name == "frame":
            return frame.select(*features, "y").write.format("noop").mode("overwrite").save()
        if name == "handoff":
            return floors[label].mapInArrow(count_rows, "n long").collect()
        return floors[label].write.parquet(os.path.join(tmp, "n"))

    for rnd in range(args.rounds + 1):  # round 0 warms up Spark's Python workers
        for label, (frame, features) in datasets.items():
            if rnd == 0:
                tmp = tempfile.mkdtemp(prefix="bench-prepare-")
                parts[label] = ours(frame, features, tmp).params["partitions"]
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            order = ["ours", "base"] + (["shuffled"] if args.shuffled else [])
            order += ["frame", "handoff", "native"] if args.floors else []
            if not rnd % 2:
                order.reverse()
            got = {}
            for name in order:
                tmp = tempfile.mkdtemp(prefix="bench-prepare-")
                if name == "ours":
                    got[name] = timed_jobs(spark, lambda: ours(frame, features, tmp))  # noqa: B023
                elif name == "shuffled":
                    got[name] = timed_jobs(spark, lambda: ours(frame, features, tmp, 1))  # noqa: B023
                elif name in ("frame", "handoff", "native"):
                    got[name] = timed_jobs(
                        spark,
                        lambda: floor_case(name, label, tmp),  # noqa: B023
                    )
                else:
                    got[name] = timed_jobs(
                        spark,
                        lambda: base(frame, features, tmp, parts[label]),  # noqa: B023
                    )
                shutil.rmtree(tmp, ignore_errors=True)
                times.setdefault(f"{label} {name}", []).append(got[name][0])
            print(
                f"round {rnd} {label:7s}: prepare_data {got['ours'][0]:.2f} s "
                f"({got['ours'][1]} jobs, {parts[label]} partitions), "
                f"baseline {got['base'][0]:.2f} s ({got['base'][1]} jobs), "
                f"ratio {got['ours'][0] / got['base'][0]:.2f}; "
                f"{got['ours'][0] / args.rows * 1e6:.2f} / {got['base'][0] / args.rows * 1e6:.2f}"
                " us/row"
                + (
                    f"; shuffled {got['shuffled'][0]:.2f} s ({got['shuffled'][1]} jobs), "
                    f"{got['shuffled'][0] / args.rows * 1e6:.2f} us/row"
                    if args.shuffled
                    else ""
                )
                + (
                    "; "
                    + ", ".join(
                        f"{n} {got[n][0]:.2f} s ({got[n][0] / args.rows * 1e6:.2f} us/row)"
                        for n in ("frame", "handoff", "native")
                    )
                    + "; prepare_data's own "
                    + f"{(got['ours'][0] - got['frame'][0]) / args.rows * 1e6:.2f} us/row"
                    if args.floors
                    else ""
                ),
                flush=True,
            )
    for label in datasets:
        ours_med = statistics.median(times[f"{label} ours"])
        base_med = statistics.median(times[f"{label} base"])
        print(
            f"median {label}: prepare_data {ours_med:.2f} s, baseline {base_med:.2f} s, "
            f"ratio {ours_med / base_med:.2f}; prepare_data {ours_med / args.rows * 1e6:.2f} us/row"
        )
        if args.shuffled:
            shuf_med = statistics.median(times[f"{label} shuffled"])
            print(
                f"median {label} shuffled: {shuf_med:.2f} s ({shuf_med / args.rows * 1e6:.2f} "
                f"us/row), prepare_data / shuffled {ours_med / shuf_med:.2f}"
            )
        if args.floors:
            meds = {
                n: statistics.median(times[f"{label} {n}"]) for n in ("frame", "handoff", "native")
            }
            own = statistics.median(
                o - f for o, f in zip(times[f"{label} ours"], times[f"{label} frame"], strict=True)
            )
            print(
                f"median {label} floors: "
                + ", ".join(
                    f"{n} {m:.2f} s ({m / args.rows * 1e6:.2f} us/row)" for n, m in meds.items()
                )
                + f"; prepare_data / native {ours_med / meds['native']:.2f}, "
                f"prepare_data / handoff {ours_med / meds['handoff']:.2f}; "
                "prepare_data's own (minus frame, per round) "
                f"{own / args.rows * 1e6:.2f} us/row"
            )
    print("load average at end:", os.getloadavg())
    spark.stop()


def count_rows(batches: Any) -> Any:
    """mapInArrow function of the "handoff" floor: receive every batch, write nothing."""
    import pyarrow as pa

    n = 0
    for batch in batches:
        n += batch.num_rows
    yield pa.RecordBatch.from_pydict({"n": [n]})


if __name__ == "__main__":
    main()
