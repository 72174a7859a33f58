"""Hierarchical vs flat allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE), same ranks, same run.

Usage: .venv/bin/python bench/hierarchical.py [--hosts 3] [--per-host 2] [--rounds 5]

``hosts x per-host`` local ranks (gloo on 127.0.0.1); each rank declares a host of its own
through ``SPARK_ESTIMATORS_HOSTNAME`` and its local/cross numbers (how a multi-host layout looks
to the library), so the hierarchical path runs exactly as across hosts, but every byte still
crosses the loopback: this measures the extra stages' cost on one machine, not the network
saving (that needs real hosts: the multi-host harness, tests/multihost). Cases, each timed
flat and hierarchical in the same round (the wrapper's switch flipped on every rank between
ops, after a barrier), in alternating order:

* one 64 MiB float32 allreduce (``allreduce_``, Sum);
* a model's gradients: the parameters of two ``torch.nn.TransformerEncoderLayer(512, 8)`` as one
  ``grouped_allreduce_`` (Average), ~25 MiB.

Prints medians and the median of the per-round ratios hierarchical / flat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _bench(hosts: int, per_host: int, rounds: int) -> dict[str, list[float]]:
    from spark_estimators import envvars as ev

    rank = int(os.environ[ev.SE_RANK])
    os.environ[ev.SE_HOSTNAME] = f"bench-host{rank // per_host}"
    os.environ[ev.SE_LOCAL_RANK], os.environ[ev.SE_LOCAL_SIZE] = str(rank % per_host), str(per_host)
    os.environ[ev.SE_CROSS_RANK], os.environ[ev.SE_CROSS_SIZE] = str(rank // per_host), str(hosts)
    return time_flat_and_hierarchical(rounds)


def time_flat_and_hierarchical(rounds: int) -> dict[str, list[float]]:
    """In a rank whose hosts are set (declared, or real ones: bench/multihost.py): each case
    timed flat and hierarchical in the same round; seconds per case and mode."""
    import torch

    from spark_estimators import envvars as ev

    os.environ[ev.HOROVOD_HIERARCHICAL_ALLREDUCE] = "1"

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init(backend="gloo")
    backend = eng.current().backend
    assert type(backend).__name__ == "HierarchicalBackend"
    big = torch.ones(16 * 1024 * 1024)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(512, 8) for _ in range(2)])
    grads = [torch.ones_like(p) for p in model.parameters()]
    cases = {
        "64MiB allreduce_": lambda: hvd.allreduce_(big, op=hvd.Sum),
        "model grads grouped_allreduce_": lambda: hvd.grouped_allreduce_(grads),
    }
    times: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in cases.items():
            order = (True, False) if r % 2 else (False, True)
            for hier in order:
                backend.allreduce_on = hier
                big.fill_(1.0)
                hvd.barrier()
                started = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - started
                if r:
                    times.setdefault(f"{name} {'hier' if hier else 'flat'}", []).append(elapsed)
    times["_local_size"] = [float(hvd.local_size())]
    hvd.shutdown()
    times["_model_mib"] = [sum(g.numel() for g in grads) * 4 / 2**20]
    return times


def summary(times: dict[str, list[float]]) -> list[str]:
    """One line per case: flat and hierarchical medians, the paired ratio."""
    lines = []
    for case in ("64MiB allreduce_", "model grads grouped_allreduce_"):
        flat, hier = times[f"{case} flat"], times[f"{case} hier"]
        paired = statistics.median(h / f for h, f in zip(hier, flat, strict=True))
        flat_ms, hier_ms = statistics.median(flat) * 1e3, statistics.median(hier) * 1e3
        lines.append(f"  {case:32s} flat {flat_ms:8.1f} ms  hier {hier_ms:8.1f} ms  "
                     f"hier/flat {paired:5.2f}x (paired)")  # fmt: skip
    return lines


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = args.hosts * args.per_host
    times = run_local(_bench, num_proc=n, args=(args.hosts, args.per_host, args.rounds),
                      backend="gloo")[0]  # fmt: skip
    mib = times["_model_mib"][0]
    print(f"{args.hosts} declared hosts x {args.per_host} ranks = {n} ranks on one machine "
          f"(gloo, loopback), {args.rounds} rounds; model grads {mib:.1f} MiB")  # fmt: skip
    print(*summary(times), sep="\n")


if __name__ == "__main__":
    main()
