"""End-to-end training: TorchEstimator.fit vs TorchDistributor + Arrow data, same run.

Usage:
    .venv/bin/python bench/fit.py --preset horovod   # 100k x 10, MLP 10-64-64-1, Adam, 2 epochs
    .venv/bin/python bench/fit.py --preset large     # 1M x 32, MLP, 1 epoch
    .venv/bin/python bench/fit.py --preset cv --rounds 2  # CrossValidator, bench/fit_cv.py
    .venv/bin/python bench/fit.py --preset horovod --horovod-python /work/venv-hvd/bin/python
    .venv/bin/python bench/fit.py --preset large --data stream   # + data="stream" side by side
    .venv/bin/python bench/fit.py --preset large --data stream --cases stream --rows 5000000

``--data parquet+stream`` adds the stream case and ``TorchEstimator(data="parquet+stream")``
(case ``copy``: trains from the stream while its tasks write the Parquet copy), followed in the
same store by a ``data="parquet"`` fit that reuses the copy; it prints when the copy's last file
was written (training started before the write ended when the first batch came earlier) and the
reusing fit's times.

``--data stream`` adds a third case each round, ``TorchEstimator(data="stream")`` (the training
stage reads the DataFrame itself, no Parquet copy), and prints stream / Parquet and
stream / TorchDistributor; ``--cases`` picks the cases to run, ``--epochs`` and ``--rows``
override the preset. Each of our fits also reports rank 0's peak RSS (``ru_maxrss`` at the end of
the last epoch, the ``rss MB`` column), the median time of its optimizer steps (``step ms``; their
mean in brackets, waits for data included) and
when its last optimizer step ended (``last step``, seconds from the fit's start: the time after it
is the fit's tail, results and model back to the driver).

The physical floor (issue 45, bench/floor.py) runs as one more case each round: plain torch, one
thread per process, one rank's share of the rows already in memory as tensors, the preset's MLP,
Adam and batch, both ranks' worth in parallel on the 2 cores. Printed per round and as warm
medians: ours / floor (total wall time of our fit over the floor's training loop) and our step /
the floor's step (median step intervals). ``--cases parquet,td`` leaves the floor out.

Both sides start from the same cached DataFrame on local[2], 2 processes, batch 256. The cases
alternate for ``--rounds`` rounds (default 6; ours first in odd rounds, TorchDistributor first in
even ones): round 1 shows a fresh session, where ours also pays for starting Spark's Python
workers (its Parquet write runs in them; the baseline's JVM write does not, and its barrier job
then finds them started); later rounds compare both warm. Each run gets a new store and a new
output directory (nothing is cached). The summary gives the medians of the warm rounds (2..N)
and of all rounds, and their ratio.
TorchDistributor follows its documentation: the DataFrame is written to Parquet, and the train
function run by ``TorchDistributor(num_processes=2, local_mode=False)`` reads its share of the
files with pyarrow into a DataLoader and trains a DDP model. Reported: total wall time from the
call to its return, and time to the first training batch (wall clock, from the same start).

Horovod 0.28.1 cannot share this virtualenv (it needs pyarrow < 11, numpy < 2 and a C++17
patch to build against torch 2.13; bench/README.md has the recipe). With
``--horovod-python /work/venv-hvd/bin/python`` (the python of that separate virtualenv) the
horovod preset also runs horovod's ``horovod.spark.torch.TorchEstimator`` side by side:
bench/fit_horovod.py starts once in a subprocess with its own warm local[2] session and the same
cached data, and runs one fit per round when asked, alternating with the two cases here (ours,
TorchDistributor, horovod in odd rounds; the reverse in even ones); the summary adds ours /
horovod per round and the medians. Without it, the summary quotes horovod's issue-20 median.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from floor import Floor

PRESETS = {
    "horovod": {"rows": 100_000, "features": 10, "hidden": [64, 64], "epochs": 2},
    "large": {"rows": 1_000_000, "features": 32, "hidden": [128, 64], "epochs": 1},
}
BATCH = 256
HOROVOD_MEDIAN_S = 17.1  # horovod 0.28.1's median on the horovod preset, side by side (issue 20)


def build_data(spark: Any, rows: int, nf: int, cache: bool = True) -> Any:
    """The preset's cached DataFrames: ``nf`` uniform float columns and ``y`` linear in them, and
    the same rows with the floats as one ML vector (``features``, ``y``).

    bench/fit_horovod.py builds horovod's data with this too (it imports only the standard
    library at the top, so horovod's virtualenv can import it).
    """
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    cols = [F.rand(seed=i).alias(f"f{i}") for i in range(nf)]
    df = spark.range(rows, numPartitions=2).select(*cols)
    df = df.withColumn("y", sum(F.col(f"f{i}") * (i + 1) for i in range(nf)) / nf)
    assembler = VectorAssembler(inputCols=[f"f{i}" for i in range(nf)], outputCol="features")
    vdf = assembler.transform(df).select("features", "y")
    if not cache:  # --no-cache: recomputed by every fit (5M rows do not fit the driver's heap)
        return df, vdf
    df = df.cache()
    df.count()
    vdf = assembler.transform(df).select("features", "y").cache()
    vdf.count()
    return df, vdf


def build_mlp(n_in: int, hidden: list[int]) -> Any:
    import torch

    layers: list[Any] = []
    prev = n_in
    for h in hidden:
        layers += [torch.nn.Linear(prev, h), torch.nn.ReLU()]
        prev = h
    layers.append(torch.nn.Linear(prev, 1))
    return torch.nn.Sequential(*layers)


def distributor_train(path: str, n_features: int, hidden: list[int], epochs: int) -> dict:
    """What a TorchDistributor user writes (after its docs): DDP over Parquet read with Arrow."""
    import glob
    import os
    import time

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(glob.glob(os.path.join(path, "*.parquet")))[rank::world]
    table = pq.read_table(files)
    x = np.stack([table.column(f"f{i}").to_numpy() for i in range(n_features)], axis=1)
    y = table.column("y").to_numpy().reshape(-1, 1)
    data = TensorDataset(
        torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))
    )
    loader = DataLoader(data, batch_size=256, shuffle=True)
    torch.manual_seed(0)
    layers: list = []
    prev = n_features
    for h in hidden:
        layers += [torch.nn.Linear(prev, h), torch.nn.ReLU()]
        prev = h
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(prev, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    first = None
    epoch_loss = 0.0
    for _ in range(epochs):
        total, rows = 0.0, 0
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(xb)
            rows += len(xb)
            if first is None:
                first = time.time()
        epoch_loss = total / max(rows, 1)  # rank 0's mean over the epoch, as ours reports
    dist.destroy_process_group()
    return {"first_batch": first, "loss": epoch_loss}


class PeakRss:
    """A TorchEstimator callback: the rank's peak RSS (MB) into the epoch logs (rank 0's kept),
    and the median interval between the ends of its optimizer steps (``step_ms``, the first 20
    of each epoch left out), the figure bench/floor.py's plain step is compared with."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        self.stamps = []

    def on_train_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        self.stamps.append(time.perf_counter())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        import resource

        logs["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        gaps = [b - a for a, b in zip(self.stamps[20:], self.stamps[21:], strict=False)]
        logs["step_ms"] = 1e3 * statistics.median(gaps) if gaps else float("nan")
        # the mean step, waits for data and slow steps included
        logs["mean_step_ms"] = 1e3 * statistics.fmean(gaps) if gaps else float("nan")
        # the last step's wall-clock time (driver and ranks share this machine's clock)
        if self.stamps:
            logs["last_step_t"] = time.time() - (time.perf_counter() - self.stamps[-1])


def fit_stream(vdf: Any, cfg: dict[str, Any]) -> dict[str, float]:
    return fit_ours(vdf, cfg, data="stream")


def fit_copy(vdf: Any, cfg: dict[str, Any]) -> dict[str, float]:
    """``data="parquet+stream"``, then a ``data="parquet"`` fit that reuses its copy.

    ``write_end_s``: when the copy's last file was closed (its newest mtime, from the fit's
    start): training started before the write ended when ``first_batch_s`` is smaller. The
    reuse fit's figures come back as ``reuse_*``.
    """
    from spark_estimators.data import load_dataset_metadata
    from spark_estimators.store import LocalStore

    tmp = tempfile.mkdtemp(prefix="bench-fit-copy-")
    try:
        out = fit_ours(vdf, cfg, data="parquet+stream", store_dir=tmp)
        meta = load_dataset_metadata(LocalStore(tmp))
        files = meta.train_files + meta.val_files
        out["write_end_s"] = max(Path(f.path).stat().st_mtime for f in files) - out["t0"]
        out["copy_rows"] = float(meta.train_rows + meta.val_rows)
        reuse = fit_ours(vdf, cfg, data="parquet", store_dir=tmp)
        out["reuse_total_s"] = reuse["total_s"]
        out["reuse_first_batch_s"] = reuse["first_batch_s"]
        out["reuse_same_dataset"] = float(
            load_dataset_metadata(LocalStore(tmp)).dataset_idx == meta.dataset_idx
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fit_ours(
    vdf: Any,
    cfg: dict[str, Any],
    data: str = "parquet",
    store_dir: str | None = None,
    callbacks: tuple[Any, ...] = (),
) -> dict[str, float]:
    """Our fit of ``cfg``'s preset; ``callbacks``: rank callbacks besides :class:`PeakRss`."""
    import torch

    from spark_estimators.core.backend import SparkBackend
    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    tmp = store_dir or tempfile.mkdtemp(prefix="bench-fit-")
    torch.manual_seed(0)
    model = build_mlp(cfg["features"], cfg["hidden"])
    marks: dict[str, float] = {}

    class Timed(SparkBackend):
        def run(self, fn, args=(), kwargs=None, env=None, event_callback=None, **extra):  # type: ignore[override]
            def both(rank: int, kind: str, data: Any) -> None:
                if kind == "first_batch":
                    marks.setdefault("first_batch", float(data))
                if event_callback is not None:
                    event_callback(rank, kind, data)

            return super().run(fn, args, kwargs, env, both, **extra)

    est = TorchEstimator(
        backend=Timed(num_proc=2, verbose=0),
        store=LocalStore(tmp),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=BATCH,
        epochs=cfg["epochs"],
        verbose=0,
        scale_lr=False,
        data=data,
        callbacks=[PeakRss(), *callbacks],
    )
    t0 = time.time()
    fitted = est.fit(vdf)
    total = time.time() - t0
    if store_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    last = fitted.getHistory()[-1]
    return {
        "t0": t0,
        "total_s": total,
        "first_batch_s": marks.get("first_batch", float("nan")) - t0,
        "loss": last["loss"],
        "rss_mb": last["rss_mb"],
        "step_ms": last["step_ms"],
        "last_step_s": last.get("last_step_t", float("nan")) - t0,
        "mean_step_ms": last.get("mean_step_ms", float("nan")),
    }


TD_HANG_S = 150.0  # a TorchDistributor fit still running after this long has hung (see below)


def _td_attempt(df: Any, cfg: dict[str, Any], path: str, group: str, box: dict) -> None:
    """One TorchDistributor fit in its own Spark job group (the thread target)."""
    from pyspark.ml.torch.distributor import TorchDistributor

    df.sparkSession.sparkContext.setJobGroup(group, "bench TD fit", interruptOnCancel=True)
    try:
        df.repartition(2).write.mode("overwrite").parquet(path)
        box["out"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
            distributor_train, path, cfg["features"], cfg["hidden"], cfg["epochs"]
        )
    except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
        box["error"] = exc


def fit_distributor(df: Any, cfg: dict[str, Any]) -> dict[str, float]:
    """One TorchDistributor fit; an attempt that hangs is cancelled and retried (not counted).

    On this machine TorchDistributor sometimes trains normally and then stalls ~300 s in
    torchrun's exit barrier (a rank dies with SIGABRT "terminate called without an active
    exception"): seen in about 1 fit of 4-20 in our runs since issue 25. Such an attempt is
    cancelled after TD_HANG_S (its Spark job group) and run again, as a crashed one is.
    """
    import threading

    for attempt in (1, 2):
        path = tempfile.mkdtemp(prefix="bench-td-")
        group = f"bench-td-{uuid.uuid4().hex[:8]}"
        box: dict[str, Any] = {}
        t0 = time.time()
        thread = threading.Thread(target=_td_attempt, args=(df, cfg, path, group, box), daemon=True)
        thread.start()
        thread.join(cfg.get("td_hang_s", TD_HANG_S))
        hung = thread.is_alive()
        if hung:
            df.sparkSession.sparkContext.cancelJobGroup(group)
            thread.join(60)
        total = time.time() - t0
        shutil.rmtree(path, ignore_errors=True)
        if hung:
            limit = cfg.get("td_hang_s", TD_HANG_S)
            print(f"TorchDistributor hung > {limit:.0f} s (attempt {attempt}): not counted")
            continue
        if "error" in box:
            raise box["error"]
        out = box["out"]
        return {"total_s": total, "first_batch_s": out["first_batch"] - t0, "loss": out["loss"]}
    raise RuntimeError(f"TorchDistributor hung twice (> {TD_HANG_S:.0f} s each)")


class HorovodServer:
    """bench/fit_horovod.py --serve run by the horovod virtualenv's python: one fit per call."""

    def __init__(self, python: str) -> None:
        script = Path(__file__).with_name("fit_horovod.py")
        self.proc = subprocess.Popen(
            [python, str(script), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"bench/fit_horovod.py exited (rc {self.proc.wait()}) before {prefix}")

    def wait_ready(self) -> None:
        self._read("READY")

    def fit(self, _frame: Any, _cfg: dict[str, Any]) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("fit\n")
        self.proc.stdin.flush()
        r = json.loads(self._read("RESULT "))
        return {"total_s": r["total_s"], "first_batch_s": float("nan"), "loss": r["loss"]}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=[*sorted(PRESETS), "cv"], default="horovod")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--horovod-python",
        metavar="PATH",
        help="python of a horovod 0.28.1 virtualenv: also run bench/fit_horovod.py side by side",
    )
    parser.add_argument(
        "--data", choices=["parquet", "stream", "parquet+stream"], default="parquet"
    )
    parser.add_argument(
        "--cases",
        default="all",
        help="comma-separated subset of parquet,stream,copy,td,floor (default: all that apply)",
    )
    parser.add_argument("--epochs", type=int, help="override the preset's epochs")
    parser.add_argument("--rows", type=int, help="override the preset's rows")
    parser.add_argument(
        "--no-cache", action="store_true", help="do not cache the DataFrames (large --rows)"
    )
    parser.add_argument(
        "--td-hang-s",
        type=float,
        default=TD_HANG_S,
        help="a TorchDistributor fit running longer is cancelled as hung (raise it on a loaded "
        f"machine; default {TD_HANG_S:.0f})",
    )
    args = parser.parse_args()
    if args.preset == "cv":  # CrossValidator vs the same fits by TorchDistributor (bench/fit_cv.py)
        from fit_cv import main_cv

        main_cv(args.rounds)
        return
    cfg = dict(PRESETS[args.preset])
    if args.epochs:
        cfg["epochs"] = args.epochs
    if args.rows:
        cfg["rows"] = args.rows
    cfg["td_hang_s"] = args.td_hang_s
    if args.horovod_python and args.preset != "horovod":
        sys.exit("--horovod-python runs only with --preset horovod (fit_horovod.py's data)")
    # started first: its Spark session and data cache build while ours do
    hvd = HorovodServer(args.horovod_python) if args.horovod_python else None

    from spark_estimators.core.session import create_local_session

    spark = create_local_session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    df, vdf = build_data(spark, cfg["rows"], cfg["features"], cache=not args.no_cache)

    ours_name, td_name = "spark_estimators TorchEstimator", "TorchDistributor + Arrow"
    stream_name = 'TorchEstimator(data="stream")'
    copy_name = 'TorchEstimator("parquet+stream")'
    wanted = {"parquet", "td", "floor"} | ({"stream"} if args.data == "stream" else set())
    if args.data == "parquet+stream":
        wanted |= {"stream", "copy"}
    if args.cases != "all":
        wanted = set(args.cases.split(","))
    floor_name = "floor: plain torch, 1 thread/rank"
    floor = Floor() if "floor" in wanted else None
    hvd_name = "horovod 0.28.1 TorchEstimator"
    if hvd is not None:
        hvd.wait_ready()
    print(f"preset {args.preset}: {cfg}, batch {BATCH}, 2 processes, local[2]")
    head = f"{'round':>5s} {'case':34s} {'total s':>8s} {'first batch s':>14s}"
    print(f"{head} {'last epoch loss':>15s}")
    totals: dict[str, list[float]] = {
        ours_name: [],
        td_name: [],
        hvd_name: [],
        stream_name: [],
        copy_name: [],
        floor_name: [],
    }
    floor_ratios: list[float] = []
    other_floor: dict[str, list[float]] = {stream_name: [], copy_name: []}
    step_ratios: list[float] = []
    ratios, hvd_ratios = [], []
    stream_ratios: dict[str, list[float]] = {ours_name: [], td_name: []}
    for rnd in range(1, args.rounds + 1):
        order = [
            case
            for key, case in (
                ("parquet", (ours_name, fit_ours, vdf)),
                ("stream", (stream_name, fit_stream, vdf)),
                ("copy", (copy_name, fit_copy, vdf)),
                ("td", (td_name, fit_distributor, df)),
                ("floor", (floor_name, lambda _frame, c: floor.measure(c), None)),  # type: ignore[union-attr]
            )
            if key in wanted
        ]
        if hvd is not None:
            order.append((hvd_name, hvd.fit, vdf))
        if rnd % 2 == 0:
            order.reverse()
        results = {name: fn(frame, cfg) for name, fn, frame in order}
        for name, r in results.items():
            totals[name].append(r["total_s"])
            print(
                f"{rnd:5d} {name:34s} {r['total_s']:8.2f} "
                f"{r.get('first_batch_s', float('nan')):14.2f} "
                f"{r.get('loss', float('nan')):15.4f}"
                + (f" rss MB {r['rss_mb']:.0f}" if "rss_mb" in r else "")
                + (f" step ms {r['step_ms']:.3f}" if "step_ms" in r else "")
                + (f" (mean {r['mean_step_ms']:.3f})" if "mean_step_ms" in r else "")
                + (
                    f" last step {r['last_step_s']:.2f} s"
                    if not math.isnan(r.get("last_step_s", math.nan))
                    else ""
                )
            )
            if "write_end_s" in r:
                started = "before" if r["first_batch_s"] < r["write_end_s"] else "after"
                print(
                    f"{rnd:5d} {'':34s} copy of {r['copy_rows']:.0f} rows written by "
                    f"{r['write_end_s']:.2f} s: training started {started} the write ended; "
                    f"then a data='parquet' fit reusing it: total {r['reuse_total_s']:.2f} s, "
                    f"first batch {r['reuse_first_batch_s']:.2f} s, same dataset "
                    f"{bool(r['reuse_same_dataset'])}",
                    flush=True,
                )
        if floor_name in results and ours_name in results:
            fl, ours_r = results[floor_name], results[ours_name]
            floor_ratios.append(ours_r["total_s"] / fl["total_s"])
            step_ratios.append(ours_r["step_ms"] / fl["step_ms"])
            print(
                f"round {rnd}: ours / floor = {floor_ratios[-1]:.2f}, "
                f"ours' step / floor's step = {step_ratios[-1]:.2f}",
                flush=True,
            )
        for other in (stream_name, copy_name):
            if floor_name in results and other in results:
                other_floor[other].append(
                    results[other]["total_s"] / results[floor_name]["total_s"]
                )
                print(f"round {rnd}: {other} / floor = {other_floor[other][-1]:.2f}", flush=True)
        if stream_name in results:
            parts = []
            for other in (ours_name, td_name):
                if other in results:
                    ratio = results[stream_name]["total_s"] / results[other]["total_s"]
                    stream_ratios[other].append(ratio)
                    parts.append(f"stream / {other.split()[0]} = {ratio:.3f}")
            print(f"round {rnd}: " + ", ".join(parts), flush=True)
        if ours_name not in results or td_name not in results:
            continue
        ours, td = results[ours_name]["total_s"], results[td_name]["total_s"]
        ratios.append(ours / td)
        line = f"round {rnd}: ours / TorchDistributor = {ours / td:.3f}"
        if hvd is not None:
            hvd_ratios.append(ours / results[hvd_name]["total_s"])
            line += f", ours / horovod = {hvd_ratios[-1]:.3f}"
        print(line, flush=True)
    for other, values in stream_ratios.items():
        if values:
            warm = values[1:] or values
            print(
                f"stream / {other} per round: "
                + ", ".join(f"{r:.3f}" for r in values)
                + f"; median of warm rounds {statistics.median(warm):.3f}"
            )
    print("ours / TorchDistributor per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    if hvd is not None:
        print("ours / horovod per round: " + ", ".join(f"{r:.3f}" for r in hvd_ratios))
    for label, first in (("all rounds", 0), ("warm rounds 2..", 1)):
        if len(ratios) <= first:
            continue
        ours_med = statistics.median(totals[ours_name][first:])
        td_med = statistics.median(totals[td_name][first:])
        line = (
            f"median of {label}: ours {ours_med:.2f} s, TorchDistributor {td_med:.2f} s, "
            f"ratio of medians {ours_med / td_med:.3f}, median of ratios "
            f"{statistics.median(ratios[first:]):.3f}"
        )
        if hvd is not None:
            hvd_med = statistics.median(totals[hvd_name][first:])
            line += (
                f"; horovod {hvd_med:.2f} s, ours / horovod: ratio of medians "
                f"{ours_med / hvd_med:.3f}, median of ratios "
                f"{statistics.median(hvd_ratios[first:]):.3f}"
            )
        elif args.preset == "horovod":
            r = ours_med / HOROVOD_MEDIAN_S
            line += f"; ours / horovod's {HOROVOD_MEDIAN_S} s (issue 20, not this run) = {r:.3f}"
        print(line)
    if floor_ratios:
        print("ours / floor per round: " + ", ".join(f"{r:.2f}" for r in floor_ratios))
        print("ours' step / floor's step per round: " + ", ".join(f"{r:.2f}" for r in step_ratios))
        first = 1 if len(floor_ratios) > 1 else 0
        ours_med = statistics.median(totals[ours_name][first:])
        floor_med = statistics.median(totals[floor_name][first:])
        print(
            f"median of {'warm rounds 2..' if first else 'all rounds'}: floor {floor_med:.2f} s, "
            f"ours / floor: ratio of medians {ours_med / floor_med:.2f}, median of ratios "
            f"{statistics.median(floor_ratios[first:]):.2f}; ours' step / floor's step: median "
            f"{statistics.median(step_ratios[first:]):.2f}"
        )
    for other, values in other_floor.items():
        if values:
            first = 1 if len(values) > 1 else 0
            other_med = statistics.median(totals[other][first:])
            floor_med = statistics.median(totals[floor_name][first:])
            print(
                f"{other} / floor per round: "
                + ", ".join(f"{r:.2f}" for r in values)
                + f"; median of {'warm rounds 2..' if first else 'all rounds'}: ratio of "
                f"medians {other_med / floor_med:.2f}, median of ratios "
                f"{statistics.median(values[first:]):.2f}"
            )
    if floor is not None:
        floor.close()
    if hvd is not None:
        hvd.close()
    spark.stop()


if __name__ == "__main__":
    main()
