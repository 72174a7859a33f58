"""Allreduce throughput: spark_estimators.collective vs raw torch.distributed, same run.

Usage: .venv/bin/python bench/allreduce.py [--repeats 10] [--num-proc 2]

Two local ranks (gloo over 127.0.0.1, started by spark_estimators.launch.run_local) time:

* one 64 MiB float32 allreduce: ``hvd.allreduce_(t, op=Sum)`` vs ``dist.all_reduce(t)``, and
  the default ``op=Average`` vs ``dist.all_reduce(t); t.div_(size)`` (target: ours >= 0.95x);
* 100 tensors of 4 KiB: one fused ``grouped_allreduce_`` vs one allreduce per tensor, ours and
  raw (target: fused >= 2x per-tensor);
* one float32 scalar (metric averaging): ours (data inside the negotiation message, one round
  trip) vs raw.

Every round runs each contender once, in a shuffled order (the same on every rank), so drift in
machine load and position effects hit all of them alike; every timed op is preceded by a
barrier. Prints the median and the best round of each, and the ratios of both.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

BIG_ELEMENTS = 16 * 1024 * 1024  # 64 MiB of float32
SMALL_COUNT, SMALL_ELEMENTS = 100, 1024  # 100 x 4 KiB


def _bench(repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import spark_estimators.collective.torch as hvd

    hvd.init(backend="gloo")
    size = hvd.size()
    big = torch.ones(BIG_ELEMENTS)
    small = [torch.ones(SMALL_ELEMENTS) for _ in range(SMALL_COUNT)]
    scalar = torch.ones(1)

    def raw_avg() -> None:
        dist.all_reduce(big)
        big.div_(size)

    def per_tensor_async() -> None:
        for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in small]:
            hvd.synchronize(h)

    cases = {
        "64MiB raw all_reduce (sum)": lambda: dist.all_reduce(big),
        "64MiB ours allreduce_ (Sum)": lambda: hvd.allreduce_(big, op=hvd.Sum),
        "64MiB raw all_reduce + div_": raw_avg,
        "64MiB ours allreduce_ (Average)": lambda: hvd.allreduce_(big),
        "100x4KiB ours fused (grouped_allreduce_)": lambda: hvd.grouped_allreduce_(
            small, op=hvd.Sum
        ),
        "100x4KiB ours per tensor": lambda: [hvd.allreduce_(t, op=hvd.Sum) for t in small],
        "100x4KiB ours per tensor, async": per_tensor_async,
        "100x4KiB raw all_reduce per tensor": lambda: [dist.all_reduce(t) for t in small],
        "scalar ours allreduce_ (Sum) x100": lambda: [
            hvd.allreduce_(scalar, op=hvd.Sum) for _ in range(100)
        ],
        "scalar raw all_reduce x100": lambda: [dist.all_reduce(scalar) for _ in range(100)],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = random.Random(0)  # same sequence on every rank
    for round_ in range(repeats + 1):  # round 0 warms up
        names = list(cases)
        if round_:
            order.shuffle(names)
        for name in names:
            dist.barrier()
            started = time.perf_counter()
            cases[name]()
            elapsed = time.perf_counter() - started
            if round_:
                times[name].append(elapsed)
    hvd.shutdown()
    return {name: (statistics.median(v), min(v)) for name, v in times.items()}


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args()
    results = run_local(_bench, num_proc=args.num_proc, args=(args.repeats,), backend="gloo")
    timings = results[0]
    gb = BIG_ELEMENTS * 4 / 1e9
    print(f"{args.num_proc} ranks, gloo on 127.0.0.1, {args.repeats} rounds (rank 0's clock)")
    print(f"{'case':42s} {'median ms':>10s} {'best ms':>8s} {'GB/s med':>9s}")
    for name, (median, best) in timings.items():
        rate = f"{gb / median:9.2f}" if name.startswith("64MiB") else f"{'':9s}"
        print(f"{name:42s} {median * 1e3:10.2f} {best * 1e3:8.2f} {rate}")
    for label, ours, theirs, target in (
        ("64MiB Sum: ours vs raw all_reduce", "64MiB ours allreduce_ (Sum)",
         "64MiB raw all_reduce (sum)", "target >= 0.95x"),
        ("64MiB Average: ours vs raw all_reduce + div_", "64MiB ours allreduce_ (Average)",
         "64MiB raw all_reduce + div_", "target >= 0.95x"),
        ("100x4KiB: fused vs ours per tensor", "100x4KiB ours fused (grouped_allreduce_)",
         "100x4KiB ours per tensor", "target >= 2x"),
        ("100x4KiB: fused vs ours async per tensor", "100x4KiB ours fused (grouped_allreduce_)",
         "100x4KiB ours per tensor, async", "target >= 2x"),
        ("100x4KiB: fused vs raw per tensor", "100x4KiB ours fused (grouped_allreduce_)",
         "100x4KiB raw all_reduce per tensor", "target >= 2x"),
        ("scalar: ours vs raw", "scalar ours allreduce_ (Sum) x100",
         "scalar raw all_reduce x100", "no target"),
    ):  # fmt: skip
        median = timings[theirs][0] / timings[ours][0]
        best = timings[theirs][1] / timings[ours][1]
        print(f"{label:46s} {median:6.2f}x median, {best:6.2f}x best ({target})")


if __name__ == "__main__":
    main()
