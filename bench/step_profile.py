"""The fit's step vs a plain step of the same model and batch, without Spark (issue 45).

    .venv/bin/python bench/step_profile.py --rows 1000000 --rounds 3
    py-spy record --subprocesses --format raw -o /tmp/steps.txt -- \\
        .venv/bin/python bench/step_profile.py --rounds 1 --cases ours

The large preset's rows (32 uniform float features as one list<float> column, ``y`` linear in
them; 4 Parquet files written here with pyarrow) in a LocalStore; ours is
``TorchEstimator.fit_on_parquet`` with ``LocalBackend(num_proc=2)`` (2 rank processes, Gloo and
the local mesh, the rank's reader, converter, DistributedOptimizer and loop as in any fit), the
floor bench/floor.py's plain loop (1 thread, rows in memory, both ranks' worth in parallel).
Both: MLP 32-128-64-1 (``--model horovod``: 10 features, MLP 10-64-64-1, the horovod
preset's), Adam lr 1e-3, MSE, batch 256. Per round, alternating order: the median
interval between optimizer steps of rank 0 (steps 21.. of the epoch) and of the floor, and the
ratio (target <= 1.3), and each side's training time. ``--breakdown`` trains ours through a
``train_minibatch_fn`` that does what the rank loop does with a clock between the parts
(between steps: the reader's hand-off and the loop's own work; forward + loss; backward with the
gradient hooks; the gradient allreduce; the optimizer) and prints rank 0's median and mean of
each (a mean well above its median: waits that come now and then, for data or for a peer), and
the floor's of its parts (forward + loss, backward, optimizer). Each round also prints rank 0's
CPU time per step by thread (from ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fit import PRESETS  # noqa: E402
from floor import Floor  # noqa: E402

CFG = {"rows": 1_000_000, "features": 32, "hidden": [128, 64], "epochs": 1}


def write_rows(path: str, rows: int, nf: int, files: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.random((rows, nf), dtype=np.float32)
    y = (x * np.arange(1, nf + 1, dtype=np.float32)).sum(1) / nf
    os.makedirs(path, exist_ok=True)
    per = -(-rows // files)
    for i in range(files):
        part = slice(i * per, min(rows, (i + 1) * per))
        column = pa.FixedSizeListArray.from_arrays(pa.array(x[part].ravel()), nf)
        table = pa.table({"features": column.cast(pa.list_(pa.float32())), "y": y[part]})
        pq.write_table(table, os.path.join(path, f"part-{i}.parquet"))


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, summed by thread name.

    Python threads by their ``threading`` name (with digits dropped), the others (torch's, Gloo's)
    by their OS name.
    """
    import re
    import threading

    names = {t.native_id: re.sub(r"\d+", "", t.name) for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class StepClock:
    """Rank callback: rank 0's step intervals and its train pass (seconds) into ``path``.

    Also the CPU time per step of each of rank 0's threads (``thread_cpu_ms``, by thread name:
    the training thread, the reader's, the collective engine's, ...), from step 20 to the last
    multiple of 200 (read while the epoch's threads still run).
    """

    def __init__(self, path: str) -> None:
        self.path, self.stamps, self.begin, self.cpu = path, [], 0.0, 0.0
        self.threads: list[tuple[int, dict[str, float]]] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        self.stamps, self.begin, self.cpu = [], time.perf_counter(), time.process_time()
        self.threads = []

    def on_train_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        self.stamps.append(time.perf_counter())
        n = len(self.stamps)
        if n == 20 or n % 200 == 0:
            self.threads = [*self.threads[:1], (n, thread_cpu())]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        import spark_estimators.collective.torch as hvd

        if hvd.rank() != 0:
            return
        gaps = [b - a for a, b in zip(self.stamps[20:], self.stamps[21:], strict=False)]
        (n0, first), (n1, last) = self.threads[0], self.threads[-1]
        threads = {
            name: 1e3 * (cpu - first.get(name, 0.0)) / max(n1 - n0, 1) for name, cpu in last.items()
        }
        with open(self.path, "w") as f:
            json.dump(
                {
                    "step_ms": 1e3 * statistics.median(gaps),
                    "train_s": self.stamps[-1] - self.begin,
                    "steps": len(self.stamps),
                    # the rank process's CPU time per step (all its threads: reader, collective)
                    "cpu_step_ms": 1e3 * (time.process_time() - self.cpu) / len(self.stamps),
                    "thread_cpu_ms": {k: v for k, v in threads.items() if v >= 0.005},
                },
                f,
            )


PARTS = ("between steps", "forward + loss", "backward + hooks", "allreduce", "optimizer")


class TimedMinibatch:
    """A ``train_minibatch_fn`` doing what the rank loop does, with a clock between the parts.

    ``between steps`` is from the end of one call to the start of the next: the rank loop's own
    work (the reader's hand-off of the next batch, callbacks, the loss sum, metrics). It travels
    to the rank pickled with the :class:`Breakdown` callback that reads its ``times``.
    """

    def __init__(self) -> None:
        self.times: list[tuple[float, ...]] = []

    def __call__(self, model, optimizer, transform_outputs, loss_fn, inputs, labels, weights):  # noqa: ANN001, ANN204
        clock = time.perf_counter
        t0 = clock()
        optimizer.zero_grad()
        outputs, matched = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, matched, weights)
        t1 = clock()
        loss.backward()
        t2 = clock()
        optimizer.synchronize()
        t3 = clock()
        with optimizer.skip_synchronize():
            optimizer.step()
        t4 = clock()
        gap = t0 - self.times[-1][-1] if self.times else 0.0
        self.times.append((gap, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4))
        return outputs, loss


class Breakdown:
    """Rank callback: rank 0's median of each part of the step (steps 21..) into ``path``."""

    def __init__(self, path: str, timed: TimedMinibatch) -> None:
        self.path, self.timed = path, timed

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        import spark_estimators.collective.torch as hvd

        if hvd.rank() == 0:
            rows = self.timed.times[21:]
            medians = {p: 1e3 * statistics.median(r[i] for r in rows) for i, p in enumerate(PARTS)}
            means = {p: 1e3 * statistics.fmean(r[i] for r in rows) for i, p in enumerate(PARTS)}
            with open(self.path, "w") as f:
                json.dump({"medians": medians, "means": means}, f)


def ours(store: Any, work: str, rnd: int, breakdown: bool = False) -> dict[str, float]:
    import torch
    from fit import build_mlp

    from spark_estimators import LocalBackend
    from spark_estimators.torch import TorchEstimator

    torch.manual_seed(0)
    model = build_mlp(CFG["features"], CFG["hidden"])
    clock = os.path.join(work, f"clock-{rnd}.json")
    timed = TimedMinibatch()
    est = TorchEstimator(
        store=store,
        backend=LocalBackend(2),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=256,
        epochs=CFG["epochs"],
        verbose=0,
        scale_lr=False,
        callbacks=[StepClock(clock)] + ([Breakdown(clock + ".parts", timed)] if breakdown else []),
        run_id=f"steps_{rnd}",
        **({"train_minibatch_fn": timed} if breakdown else {}),
    )
    t0 = time.time()
    est.fit_on_parquet()
    total = time.time() - t0
    with open(clock) as f:
        out = json.load(f)
    out["total_s"] = total
    if breakdown:
        with open(clock + ".parts") as f:
            out["parts"] = json.load(f)
    return out


def main() -> None:
    from spark_estimators.store import LocalStore

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=CFG["rows"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="ours,floor")
    parser.add_argument(
        "--model", choices=sorted(PRESETS), default="large", help="bench/fit.py's preset's model"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time the parts of our step (a train_minibatch_fn that does what the loop does)",
    )
    args = parser.parse_args()
    CFG["rows"] = args.rows
    CFG["features"], CFG["hidden"] = PRESETS[args.model]["features"], PRESETS[args.model]["hidden"]
    cases = args.cases.split(",")
    work = tempfile.mkdtemp(prefix="bench-steps-")
    store = LocalStore(work)
    write_rows(store.get_train_data_path(), args.rows, CFG["features"])
    floor = Floor() if "floor" in cases else None
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for rnd in range(1, args.rounds + 1):
        order = [c for c in ("ours", "floor") if c in cases]
        if rnd % 2 == 0:
            order.reverse()
        res = {}
        for case in order:
            if case == "ours":
                res[case] = ours(store, work, rnd, args.breakdown)
            else:
                res[case] = floor.measure(CFG, parts=args.breakdown)  # type: ignore[union-attr]
        if "ours" in res:
            r = res["ours"]
            print(
                f"round {rnd}: ours step {r['step_ms']:.3f} ms, "
                f"CPU {r['cpu_step_ms']:.3f} ms/step, "
                f"train {r['train_s']:.2f} s, "
                f"fit {r['total_s']:.2f} s",
                flush=True,
            )
            busy = sorted(r["thread_cpu_ms"].items(), key=lambda kv: -kv[1])
            print(
                f"round {rnd}: rank 0's CPU per step by thread (ms): "
                + ", ".join(f"{k} {v:.3f}" for k, v in busy)
            )
        if "parts" in res.get("ours", {}):
            parts = res["ours"]["parts"]
            for kind in ("medians", "means"):
                print(
                    f"round {rnd}: ours' step parts ({kind}, ms): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in parts[kind].items())
                )
        if "floor" in res:
            f = res["floor"]
            print(
                f"round {rnd}: floor step {f['step_ms']:.3f} ms, CPU {f['cpu_step_ms']:.3f} "
                f"ms/step, train {f['total_s']:.2f} s"
            )
            if "parts" in f:
                print(
                    f"round {rnd}: floor's step parts (worker 0's medians, ms): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in f["parts"].items())
                )
        if len(res) == 2:
            ratios.append(res["ours"]["step_ms"] / res["floor"]["step_ms"])
            cpu_ratios.append(res["ours"]["cpu_step_ms"] / res["floor"]["cpu_step_ms"])
            print(
                f"round {rnd}: ours' step / floor's step = {ratios[-1]:.2f}, "
                f"CPU per step {cpu_ratios[-1]:.2f}",
                flush=True,
            )
    if ratios:
        print(
            "step ratio per round: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f"; median {statistics.median(ratios):.2f}"
        )
        print(
            "CPU per step ratio per round: "
            + ", ".join(f"{r:.2f}" for r in cpu_ratios)
            + f"; median {statistics.median(cpu_ratios):.2f}"
        )
    if floor is not None:
        floor.close()


if __name__ == "__main__":
    main()
