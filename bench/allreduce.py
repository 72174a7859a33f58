"""Allreduce throughput: spark_estimators.collective vs the raw library underneath, same run.

Usage: .venv/bin/python bench/allreduce.py [--repeats 10] [--num-proc 2] [--backends gloo,mpi]
[--tensorflow] [--small] [--horovod-python /work/venv-hvd/bin/python [--blocks 2]]

For each backend, N local ranks (started by spark_estimators.launch.run_local: gloo over
127.0.0.1; mpi through the launcher's PMI server, i.e. a real MPI_COMM_WORLD as under mpiexec)
time:

* one 64 MiB float32 allreduce: ``hvd.allreduce_(t, op=Sum)`` vs the raw call
  (``dist.all_reduce(t)`` for gloo, ``comm.Allreduce(IN_PLACE, a)`` of mpi4py for mpi), and the
  default ``op=Average`` vs the raw call followed by a division (target: ours >= 0.95x);
* 100 tensors of 4 KiB: one fused ``grouped_allreduce_`` vs one allreduce per tensor, ours and
  raw (target: fused >= 2x per-tensor); and Horovod's DistributedOptimizer pattern, 100
  ``allreduce_async_`` then ``synchronize`` each, which the engine fuses (issue 25 targets on 2
  ranks: async <= 1.5x our grouped time, grouped <= 2.33 ms, Horovod 0.28.1's time on the same
  machine); the raw equivalent of the fused op is ``torch.cat`` + one ``dist.all_reduce`` + copying
  back;
* one float32 scalar (metric averaging): ours (data inside the negotiation message, one round
  trip) vs raw;
* with ``--tensorflow``: one 64 MiB float32 ``tf.Tensor`` through the TensorFlow adapter
  (``spark_estimators.collective.tensorflow.allreduce(t, op=Sum)``, out of place) vs the torch
  adapter's out-of-place ``allreduce(t, op=Sum)`` on a torch tensor (target: >= 0.9x).

``--rounds-json PATH`` writes every round's seconds (ours per backend, horovod's) as JSON.
``--small`` runs only the 100 x 4 KiB cases (issue 45's target: async <= 1.2x our grouped call
and <= horovod 0.28.1's async median). ``--horovod-python PATH`` (the python of the horovod
virtualenv of bench/README.md) also runs horovod's side of those cases, bench/allreduce_horovod.py
(2 ranks over Gloo on this host, ``horovod.run``), and prints its medians and the ratios; with
``--blocks N`` ours and horovod's jobs alternate N times (each ``--repeats`` rounds), and the
rounds of all blocks are pooled, so that a drift in the machine's load hits both sides alike.

Every round runs each contender once, in a shuffled order (the same on every rank), so drift in
machine load and position effects hit all of them alike; every timed op is preceded by a
barrier. Prints the median and the best round of each, and per backend the ratios of both plus
the median of the per-round ratios ("paired": both contenders ran in the same round, which
cancels most of the drift of a shared machine's load).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BIG_ELEMENTS = 16 * 1024 * 1024  # 64 MiB of float32
SMALL_COUNT, SMALL_ELEMENTS = 100, 1024  # 100 x 4 KiB
BACKENDS = ("gloo", "mpi")


def _raw_gloo(big: Any, small: list[Any], scalar: Any) -> tuple[dict[str, Any], Any]:
    import torch.distributed as dist

    size = dist.get_world_size()

    def avg() -> None:
        dist.all_reduce(big)
        big.div_(size)

    def fused() -> None:
        import torch

        flat = torch.cat(small)
        dist.all_reduce(flat)
        for t, part in zip(small, flat.split([t.numel() for t in small]), strict=True):
            t.copy_(part)

    cases = {
        "64MiB raw sum": lambda: dist.all_reduce(big),
        "64MiB raw sum + div": avg,
        "100x4KiB raw per tensor": lambda: [dist.all_reduce(t) for t in small],
        "100x4KiB raw fused (cat + 1 call)": fused,
        "scalar raw x100": lambda: [dist.all_reduce(scalar) for _ in range(100)],
    }
    return cases, dist.barrier


def _raw_mpi(big: Any, small: list[Any], scalar: Any) -> tuple[dict[str, Any], Any]:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # the user's own communicator, as in a mixed program
    size = comm.Get_size()
    big_np, small_np, scalar_np = big.numpy(), [t.numpy() for t in small], scalar.numpy()

    def avg() -> None:
        comm.Allreduce(MPI.IN_PLACE, big_np)
        np.divide(big_np, size, out=big_np)

    def per_tensor() -> None:
        for a in small_np:
            comm.Allreduce(MPI.IN_PLACE, a)

    def scalars() -> None:
        for _ in range(100):
            comm.Allreduce(MPI.IN_PLACE, scalar_np)

    def fused() -> None:
        flat = np.concatenate(small_np)
        comm.Allreduce(MPI.IN_PLACE, flat)
        for a, part in zip(small_np, np.split(flat, len(small_np)), strict=True):
            a[...] = part

    cases = {
        "64MiB raw sum": lambda: comm.Allreduce(MPI.IN_PLACE, big_np),
        "64MiB raw sum + div": avg,
        "100x4KiB raw per tensor": per_tensor,
        "100x4KiB raw fused (cat + 1 call)": fused,
        "scalar raw x100": scalars,
    }
    return cases, comm.Barrier


def _tf_cases() -> dict[str, Any]:
    import tensorflow as tf
    import torch

    import spark_estimators.collective.tensorflow as hvd_tf
    import spark_estimators.collective.torch as hvd

    tf_big = tf.ones([BIG_ELEMENTS])
    torch_big = torch.ones(BIG_ELEMENTS)
    return {
        "64MiB TF adapter allreduce (Sum)": lambda: hvd_tf.allreduce(tf_big, op=hvd_tf.Sum),
        "64MiB torch adapter allreduce (Sum)": lambda: hvd.allreduce(torch_big, op=hvd.Sum),
    }


def _bench(
    backend: str,
    repeats: int,
    tensorflow: bool = False,
    small_only: bool = False,
    no_raw: bool = False,
) -> dict[str, Any]:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init(backend=backend)
    big = torch.ones(BIG_ELEMENTS)
    small = [torch.ones(SMALL_ELEMENTS) for _ in range(SMALL_COUNT)]
    scalar = torch.ones(1)

    def per_tensor_async() -> None:
        for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in small]:
            hvd.synchronize(h)

    raw: Callable[..., tuple[dict[str, Any], Any]] = _raw_mpi if backend == "mpi" else _raw_gloo
    raw_cases, barrier = raw(big, small, scalar)
    cases = {
        **raw_cases,
        "64MiB ours allreduce_ (Sum)": lambda: hvd.allreduce_(big, op=hvd.Sum),
        "64MiB ours allreduce_ (Average)": lambda: hvd.allreduce_(big),
        "100x4KiB ours fused (grouped_allreduce_)": lambda: hvd.grouped_allreduce_(
            small, op=hvd.Sum
        ),
        "100x4KiB ours per tensor": lambda: [hvd.allreduce_(t, op=hvd.Sum) for t in small],
        "100x4KiB ours per tensor, async": per_tensor_async,
        "scalar ours allreduce_ (Sum) x100": lambda: [
            hvd.allreduce_(scalar, op=hvd.Sum) for _ in range(100)
        ],
    }
    if tensorflow:
        cases.update(_tf_cases())
    if small_only:
        cases = {k: v for k, v in cases.items() if k in SMALL_CASES}
    if no_raw:  # the rounds horovod's side runs: its cases only, nothing between them
        cases = {k: v for k, v in cases.items() if k not in raw_cases}
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = random.Random(0)  # same sequence on every rank
    for round_ in range(repeats + 1):  # round 0 warms up
        names = list(cases)
        if round_:
            order.shuffle(names)
        for name in names:
            for t in (big, scalar, *small):  # untimed: keep the sums finite round after round
                t.fill_(1.0)
            barrier()
            started = time.perf_counter()
            cases[name]()
            elapsed = time.perf_counter() - started
            if round_:
                times[name].append(elapsed)
    hvd.shutdown()
    return times


HOROVOD_GROUPED_MS, HOROVOD_ASYNC_MS = 2.33, 3.4  # issue 25's figures, when not run live
RAW_NAMES = {"gloo": "torch.distributed", "mpi": "mpi4py"}
ASYNC, GROUPED = "100x4KiB ours per tensor, async", "100x4KiB ours fused (grouped_allreduce_)"
SMALL_CASES = (ASYNC, GROUPED, "100x4KiB raw fused (cat + 1 call)")  # --small
HVD_ASYNC = "100x4KiB horovod per tensor, async"  # bench/allreduce_horovod.py's names
HVD_GROUPED = "100x4KiB horovod fused (grouped_allreduce_)"
RATIOS = (
    ("64MiB Sum: ours vs raw", "64MiB ours allreduce_ (Sum)", "64MiB raw sum", ">= 0.95x"),
    ("64MiB Average: ours vs raw + div", "64MiB ours allreduce_ (Average)",
     "64MiB raw sum + div", ">= 0.95x"),
    ("100x4KiB: fused vs ours per tensor", GROUPED, "100x4KiB ours per tensor", ">= 2x"),
    ("100x4KiB: ours async / ours grouped", GROUPED, ASYNC, "<= 1.2x"),
    ("100x4KiB: raw fused / ours grouped", GROUPED, "100x4KiB raw fused (cat + 1 call)", "none"),
    ("100x4KiB: raw fused / ours async", ASYNC, "100x4KiB raw fused (cat + 1 call)", "none"),
    ("100x4KiB: fused vs raw per tensor", GROUPED, "100x4KiB raw per tensor", ">= 2x"),
    ("scalar: ours vs raw", "scalar ours allreduce_ (Sum) x100", "scalar raw x100", "none"),
)  # fmt: skip
TF_RATIO = ("64MiB Sum: TF adapter vs torch adapter", "64MiB TF adapter allreduce (Sum)",
            "64MiB torch adapter allreduce (Sum)", ">= 0.9x")  # fmt: skip


def _horovod(python: str, repeats: int, num_proc: int) -> dict[str, list[float]]:
    """bench/allreduce_horovod.py run by the horovod virtualenv's ``python``: its rounds."""
    script = Path(__file__).with_name("allreduce_horovod.py")
    cmd = [python, str(script), "--repeats", str(repeats), "--num-proc", str(num_proc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--tensorflow", action="store_true", help="add the TF adapter cases")
    parser.add_argument("--small", action="store_true", help="only the 100 x 4 KiB cases")
    parser.add_argument("--horovod-python", help="python of the horovod 0.28.1 virtualenv")
    parser.add_argument(
        "--no-raw",
        action="store_true",
        help="leave out the raw torch.distributed cases, so ours runs the rounds horovod's side "
        "runs (a raw Gloo allreduce of 400 KB between them slowed our next round by ~1.5x)",
    )
    parser.add_argument("--blocks", type=int, default=1, help="alternate ours/horovod N times")
    parser.add_argument("--rounds-json", help="write every round (seconds, ours and horovod) here")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    rounds: dict[str, dict[str, list[float]]] = {b: {} for b in backends}
    hvd_rounds: dict[str, list[float]] = {}
    for _ in range(args.blocks if args.horovod_python else 1):
        for b in backends:
            bench_args = (b, args.repeats, args.tensorflow, args.small, args.no_raw)
            job = run_local(_bench, num_proc=args.num_proc, backend=b, args=bench_args)[0]
            for name, values in job.items():
                rounds[b].setdefault(name, []).extend(values)
        if args.horovod_python:
            for name, values in _horovod(args.horovod_python, args.repeats, args.num_proc).items():
                hvd_rounds.setdefault(name, []).extend(values)
    if args.rounds_json:
        every = {"ours": rounds, "horovod": hvd_rounds}
        Path(args.rounds_json).write_text(json.dumps(every, indent=1))
    timings = {
        b: {name: (statistics.median(v), min(v)) for name, v in per_case.items()}
        for b, per_case in rounds.items()
    }
    gb = BIG_ELEMENTS * 4 / 1e9
    total = len(next(iter(rounds[backends[0]].values())))
    print(f"{args.num_proc} ranks on 127.0.0.1, {total} rounds (rank 0's clock); raw = "
          + ", ".join(f"{RAW_NAMES[b]} for {b}" for b in backends))  # fmt: skip
    head = "".join(f" {b + ' med ms':>13s} {b + ' best':>10s}" for b in backends)
    print(f"{'case':42s}{head}")
    for name in timings[backends[0]]:
        row = "".join(
            f" {timings[b][name][0] * 1e3:13.2f} {timings[b][name][1] * 1e3:10.2f}"
            for b in backends
        )
        print(f"{name:42s}{row}")
    for name, values in hvd_rounds.items():
        print(f"{name:42s} {statistics.median(values) * 1e3:13.2f} {min(values) * 1e3:10.2f}"
              "  (horovod 0.28.1, gloo)")  # fmt: skip
    if "64MiB ours allreduce_ (Sum)" in timings[backends[0]]:
        print(f"{'64MiB ours Sum, GB/s (median)':42s}" + "".join(
            f" {gb / timings[b]['64MiB ours allreduce_ (Sum)'][0]:13.2f} {'':10s}"
            for b in backends
        ))  # fmt: skip
    print()
    for label, ours, theirs, target in RATIOS + ((TF_RATIO,) if args.tensorflow else ()):
        if ours not in timings[backends[0]] or theirs not in timings[backends[0]]:
            continue
        cells = []
        for b in backends:
            median = timings[b][theirs][0] / timings[b][ours][0]
            best = timings[b][theirs][1] / timings[b][ours][1]
            # Both ran in the same round: the ratio per round cancels slow drift in load.
            paired = statistics.median(
                t / o for t, o in zip(rounds[b][theirs], rounds[b][ours], strict=True)
            )
            cells.append(f"{b}: {median:5.2f}x med {best:5.2f}x best {paired:5.2f}x paired")
        print(f"{label:42s} " + " | ".join(cells) + f"  (target {target})")
    for b in backends:
        grouped, async_ = timings[b][GROUPED][0] * 1e3, timings[b][ASYNC][0] * 1e3
        if not hvd_rounds:  # Horovod 0.28.1's figures measured on the 2-core sandbox (issue 25)
            print(f"{b}: 100x4KiB median grouped {grouped:.2f} ms (Horovod 0.28.1: "
                  f"{HOROVOD_GROUPED_MS} ms, target <=), async {async_:.2f} ms (Horovod 0.28.1: "
                  f"{HOROVOD_ASYNC_MS} ms)")  # fmt: skip
            continue
        hvd_async = statistics.median(hvd_rounds[HVD_ASYNC]) * 1e3
        hvd_grouped = statistics.median(hvd_rounds[HVD_GROUPED]) * 1e3
        print(f"{b}: 100x4KiB async: ours {async_:.2f} ms, horovod {hvd_async:.2f} ms, ours / "
              f"horovod {async_ / hvd_async:.2f}x (target <= 1x); ours async / ours grouped "
              f"{async_ / grouped:.2f}x (target <= 1.2x); grouped: ours {grouped:.2f} ms, "
              f"horovod {hvd_grouped:.2f} ms ({grouped / hvd_grouped:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
