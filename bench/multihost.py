"""Across hosts: a 64 MiB allreduce between two hosts (ours vs raw Gloo) and the horovod preset fit
on 3 hosts vs 1 host, on the multi-host harness (tests/multihost/netns.py; needs root).

Usage (as root, from the repository root):
    PYTHONPATH=$PWD .venv/bin/python bench/multihost.py [--repeats 10] [--rounds 3]
    (--cases allreduce,hierarchical,fit: any of them; all by default)

It builds the harness's three hosts (network namespaces on one bridge, a Spark standalone Worker
of 2 cores in each) and then, each with a driver of its own in the driver host:

* allreduce: a session of 2 executors with ``spark.task.cpus=2`` (one task slot per executor,
  so ``run(num_proc=2)`` puts its two ranks on two hosts; the ranks check that). Each round
  times one 64 MiB float32 ``hvd.allreduce_(t, op=Sum)`` (ours: the engine over Gloo) and one
  ``torch.distributed.all_reduce(t)`` on the same Gloo process group (raw), in a shuffled order
  the same on both ranks, each after a barrier; target ours >= 0.95x raw.
* hierarchical (issue 46): 6 ranks, 2 on each host (the default session: 3 executors of 2
  slots), ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``; bench/hierarchical.py's cases (64 MiB Sum, a
  model's gradients grouped), each timed flat and hierarchical in the same round by flipping the
  wrapper's switch on every rank after a barrier.
* fit: bench/fit.py's horovod preset (100k x 10, MLP 10-64-64-1, Adam 1e-3, 2 epochs, batch
  256 per rank, Parquet in a fresh LocalStore per fit, ``scale_lr=False``) with
  ``TorchEstimator``: on 1 host (a session of one executor: 2 ranks) and on 3 hosts (3
  executors: 6 ranks, 2 per host), ``--rounds`` fits each, total seconds from ``fit`` to its
  return. The first fit of each session pays for cold Python workers; the median is of the others.

The hosts share one machine: their "network" is a veth bridge in memory, so the allreduce
measures our engine's overhead over Gloo's TCP between hosts, not a NIC; 6 ranks on 3 hosts
share the machine's cores, so the fit shows the cost of going across hosts, not a speed-up.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIG_ELEMENTS = 16 * 1024 * 1024  # 64 MiB of float32


# -- what the ranks run -----------------------------------------------------------------------
def allreduce_rounds(repeats: int) -> dict[str, Any]:
    """64 MiB Sum, ours vs raw torch.distributed on the same Gloo group; seconds per round."""
    import torch
    import torch.distributed as dist

    import spark_estimators.collective.torch as hvd

    hvd.init(backend="gloo")
    big = torch.ones(BIG_ELEMENTS)
    cases = {
        "ours": lambda: hvd.allreduce_(big, op=hvd.Sum),
        "raw": lambda: dist.all_reduce(big),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = random.Random(0)  # same sequence on every rank
    for round_ in range(repeats + 1):  # round 0 warms up
        names = list(cases)
        order.shuffle(names)
        for name in names:
            big.fill_(1.0)
            dist.barrier()
            started = time.perf_counter()
            cases[name]()
            elapsed = time.perf_counter() - started
            assert float(big[0]) == hvd.size(), float(big[0])
            if round_:
                times[name].append(elapsed)
    out = {
        "host": socket.gethostname(),
        "local_size": hvd.local_size(),
        "cross_size": hvd.cross_size(),
        "times": times,
    }
    hvd.shutdown()
    return out


# -- driver side (run inside the harness's driver agent, scenario "call") --------------------
def allreduce_scenario(spark: Any, repeats: int) -> dict[str, Any]:
    import spark_estimators

    ranks = spark_estimators.run(
        allreduce_rounds, args=(repeats,), num_proc=2, spark=spark, verbose=0
    )
    return {"ranks": ranks}


def hierarchical_ranks(rounds: int) -> dict[str, Any]:
    """bench/hierarchical.py's flat vs hierarchical timings, on the harness's real hosts."""
    sys.path.insert(0, str(HERE))
    from hierarchical import time_flat_and_hierarchical  # bench/hierarchical.py

    times = time_flat_and_hierarchical(rounds)
    return {
        "host": socket.gethostname(),
        "times": times,
        "local_size": int(times["_local_size"][0]),
    }


def hierarchical_scenario(spark: Any, rounds: int) -> dict[str, Any]:
    import spark_estimators

    ranks = spark_estimators.run(
        hierarchical_ranks, args=(rounds,), num_proc=6, spark=spark, verbose=0
    )
    return {"ranks": ranks}


def fit_scenario(spark: Any, num_proc: int, rounds: int, workdir: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import torch
    from fit import BATCH, PRESETS, build_data, build_mlp  # bench/fit.py

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    cfg = PRESETS["horovod"]
    _, vdf = build_data(spark, cfg["rows"], cfg["features"])
    totals, losses = [], []
    for _ in range(rounds):
        store_dir = tempfile.mkdtemp(prefix="bench-mh-", dir=workdir)
        torch.manual_seed(0)
        model = build_mlp(cfg["features"], cfg["hidden"])
        est = TorchEstimator(
            num_proc=num_proc, store=LocalStore(store_dir), model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), loss=torch.nn.MSELoss(),
            feature_cols=["features"], label_cols=["y"], batch_size=BATCH,
            epochs=cfg["epochs"], verbose=0, scale_lr=False,
        )  # fmt: skip
        started = time.time()
        fitted = est.fit(vdf)
        totals.append(time.time() - started)
        losses.append(float(fitted.getHistory()[-1]["loss"]))
        shutil.rmtree(store_dir, ignore_errors=True)
    return {"totals": totals, "losses": losses}


# -- the harness (this process, as root) -----------------------------------------------------
def _call(agent: Any, function: str, timeout: float, **kwargs: Any) -> dict[str, Any]:
    answer: dict[str, Any] = agent.call(
        "call", timeout=timeout, path=str(Path(__file__).resolve()), function=function,
        kwargs=kwargs,
    )  # fmt: skip
    if "error" in answer:
        raise RuntimeError(f"{function}: {answer['error']}\n{answer.get('tb')}")
    return answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10, help="allreduce rounds")
    parser.add_argument("--rounds", type=int, default=3, help="fits per number of hosts")
    parser.add_argument("--cases", default="allreduce,hierarchical,fit", help="comma-separated")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))
    import netns

    cluster = netns.Cluster()
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    try:
        cluster.create_network()
        cluster.start_spark()
        if "allreduce" in cases:
            _allreduce(netns, cluster, args.repeats)
            load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        if "hierarchical" in cases:
            _hierarchical(netns, cluster, args.repeats)
            load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        if "fit" in cases:
            _fits(netns, cluster, args.rounds, load)
        print("load:", *load, sep="\n  ")
    finally:
        cluster.close()


def _allreduce(netns: Any, cluster: Any, repeats: int) -> None:
    """64 MiB between two hosts: one task slot per executor, two executors."""
    agent = netns.DriverAgent(
        cluster, key="driver-allreduce", conf={"spark.task.cpus": "2"}, executors=2
    )
    try:
        ranks = _call(agent, "allreduce_scenario", 900, repeats=repeats)["ranks"]
    finally:
        agent.close()
    hosts = {r["host"] for r in ranks}
    if len(hosts) != 2 or {r["cross_size"] for r in ranks} != {2}:
        raise RuntimeError(f"the two ranks are not on two hosts: {ranks}")
    times = ranks[0]["times"]
    ours, raw = statistics.median(times["ours"]), statistics.median(times["raw"])
    paired = statistics.median(r / o for r, o in zip(times["raw"], times["ours"], strict=True))
    gb = BIG_ELEMENTS * 4 / 1e9
    print(f"64 MiB float32 allreduce (Sum), 2 ranks on {sorted(hosts)}, {repeats} rounds "
          f"(rank 0's clock)")  # fmt: skip
    print(f"  ours (engine over Gloo)   median {ours * 1e3:8.1f} ms  best "
          f"{min(times['ours']) * 1e3:8.1f} ms  {gb / ours:5.2f} GB/s")  # fmt: skip
    print(f"  raw torch.distributed     median {raw * 1e3:8.1f} ms  best "
          f"{min(times['raw']) * 1e3:8.1f} ms  {gb / raw:5.2f} GB/s")  # fmt: skip
    print(f"  ours vs raw: {raw / ours:.2f}x median, {paired:.2f}x paired (target >= 0.95x)")


def _hierarchical(netns: Any, cluster: Any, rounds: int) -> None:
    """Flat vs hierarchical allreduce, 3 hosts x 2 ranks, in one job."""
    sys.path.insert(0, str(HERE))
    from hierarchical import summary  # bench/hierarchical.py

    agent = netns.DriverAgent(cluster, key="driver-hierarchical")
    try:
        ranks = _call(agent, "hierarchical_scenario", 1800, rounds=rounds)["ranks"]
    finally:
        agent.close()
    hosts = [r["host"] for r in ranks]
    if len(set(hosts)) != 3 or {r["local_size"] for r in ranks} != {2}:
        raise RuntimeError(f"the six ranks are not 2 on each of 3 hosts: {hosts}")
    times = ranks[0]["times"]
    print(
        f"\nhierarchical vs flat allreduce, 6 ranks on {sorted(set(hosts))} (2 each), "
        f"{rounds} rounds (rank 0's clock); model grads {times['_model_mib'][0]:.1f} MiB"
    )
    print(*summary(times), sep="\n")


def _fits(netns: Any, cluster: Any, rounds: int, load: list[str]) -> None:
    """The horovod preset on 1 host (2 ranks), then on 3 hosts (6 ranks)."""
    fits = {}
    for n_hosts in (1, 3):
        agent = netns.DriverAgent(cluster, key=f"driver-fit{n_hosts}", executors=n_hosts)
        try:
            fits[n_hosts] = _call(
                agent, "fit_scenario", 1800, num_proc=2 * n_hosts, rounds=rounds,
                workdir=cluster.workdir,
            )  # fmt: skip
        finally:
            agent.close()
        load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"\nhorovod preset fit (TorchEstimator, Parquet), {rounds} fits each")
    warm = {}
    for n_hosts, res in fits.items():
        warm[n_hosts] = statistics.median(res["totals"][1:] or res["totals"])
        print(f"  {n_hosts} host(s), {2 * n_hosts} ranks: totals "
              + ", ".join(f"{t:.1f}" for t in res["totals"])
              + f" s; warm median {warm[n_hosts]:.1f} s; last loss "
              + ", ".join(f"{x:.4f}" for x in res["losses"]))  # fmt: skip
    print(f"  3 hosts / 1 host (warm medians): {warm[3] / warm[1]:.2f}x")


if __name__ == "__main__":
    main()
