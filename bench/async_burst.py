"""A burst of async allreduces against one grouped call, interleaved in one job (issue 45).

    .venv/bin/python bench/async_burst.py [--rounds 400] [--tensors 100] [--elements 1024]

2 ranks over 127.0.0.1 (``run_local``, Gloo). Each round runs, in a shuffled order (the same on
every rank), Horovod's ``DistributedOptimizer`` pattern (``allreduce_async_`` per tensor, then
``synchronize`` each handle) and ``grouped_allreduce_`` of the same tensors, each after a
barrier; 20 warm-up rounds are dropped. Prints, per rank, the 10th / 50th / 90th percentile of
each (ms), the async burst's parts (submitting every op; the first ``synchronize``, which runs
the fused batch; the rest) and the ratio of the medians (issue 45's target: <= 1.2x).

Unlike ``bench/allreduce.py --small``, which runs each case in its own job next to horovod's, the
two contenders share one job and alternate round by round, so the ratio is not at the mercy of
the machine's drift between jobs; horovod's side is in ``bench/allreduce.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WARMUP = 20


def _rank(rounds: int, tensors: int, elements: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import spark_estimators.collective.torch as hvd

    torch.set_num_threads(1)
    hvd.init(backend="gloo")
    small = [torch.ones(elements) for _ in range(tensors)]
    rec: dict[str, list[float]] = {"grouped": [], "async": [], "submit": [], "first": [],
                                   "rest": []}  # fmt: skip
    order = random.Random(0)
    clock = time.perf_counter
    for r in range(rounds + WARMUP):
        names = ["grouped", "async"]
        order.shuffle(names)
        for name in names:
            for t in small:
                t.fill_(1.0)
            dist.barrier()
            t0 = clock()
            if name == "grouped":
                hvd.grouped_allreduce_(small, op=hvd.Sum)
                t3 = clock()
            else:
                handles = [hvd.allreduce_async_(t, op=hvd.Sum) for t in small]
                t1 = clock()
                hvd.synchronize(handles[0])
                t2 = clock()
                for h in handles[1:]:
                    hvd.synchronize(h)
                t3 = clock()
                if r >= WARMUP:
                    rec["submit"].append(t1 - t0)
                    rec["first"].append(t2 - t1)
                    rec["rest"].append(t3 - t2)
            if r >= WARMUP:
                rec[name].append(t3 - t0)
        if not all(t[0].item() == hvd.size() for t in small):
            raise AssertionError("wrong sums")
    hvd.shutdown()
    return rec


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--elements", type=int, default=1024)
    args = parser.parse_args()
    results: list[Any] = run_local(_rank, num_proc=2, args=(args.rounds, args.tensors,
                                                           args.elements))  # fmt: skip
    print(f"{args.tensors} x {args.elements * 4 // 1024} KiB, 2 ranks, {args.rounds} rounds; "
          "ms at the 10th / 50th / 90th percentile")  # fmt: skip
    for rank, rec in enumerate(results):
        parts = []
        for key, values in rec.items():
            q = statistics.quantiles(values, n=10)
            parts.append(f"{key} {q[0] * 1e3:.3f} / {q[4] * 1e3:.3f} / {q[8] * 1e3:.3f}")
        ratio = statistics.median(rec["async"]) / statistics.median(rec["grouped"])
        print(f"rank {rank}: " + "; ".join(parts))
        print(f"rank {rank}: async / grouped (medians) {ratio:.3f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()
