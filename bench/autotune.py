"""Autotune against a grid of fusion thresholds, on two workloads whose best threshold differs.

Usage: .venv/bin/python bench/autotune.py [--num-proc 2] [--steps 40] [--rounds 3]
[--max-samples 12] [--steps-per-sample 5]

Workloads (one training "step" = submit every tensor with ``allreduce_async_``, then
``synchronize`` them all, as DistributedOptimizer does):

* ``many-small``: 256 tensors of 4 KiB (1 MiB a step): fusing them saves rounds, so the best
  threshold is large.
* ``few-large``: 4 tensors of 8 MiB (32 MiB a step): fusing copies them into and out of the
  fusion buffer for no saved round worth it, so a threshold below 8 MiB (no fusion) is best.

For each workload, one ``run_local`` job (N ranks on 127.0.0.1, gloo, cycle time held at 1 ms)
first trains with ``HOROVOD_AUTOTUNE=1`` until the tuner is done (the tuning phase, timed, its
steps counted), then runs ``--rounds`` rounds; each round times ``--steps`` steps at every grid
threshold and at the setting autotune kept, in a shuffled order (the same on every rank; the
threshold is set on every rank after a barrier, when nothing is in flight). Medians over rounds,
and the median of the per-round ratios (both ran in the same round, which cancels most of the
drift of a shared machine's load). Prints the tuned throughput against the best grid point
(target >= 0.95x) and the tuning phase's cost: its time, and the time the same number of steps
take at the best grid point.
"""

from __future__ import annotations

import argparse
import statistics
import time

WORKLOADS = {"many-small": (256, 1024), "few-large": (4, 2 * 1024 * 1024)}  # count, float32s
GRID = (0, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 64 * 1024 * 1024)


def _job(workload: str, steps: int, rounds: int) -> dict:
    import random

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init(backend="gloo")
    engine = eng.current()
    count, numel = WORKLOADS[workload]
    grads = [torch.ones(numel) for _ in range(count)]

    def step() -> None:
        for h in [hvd.allreduce_async_(g, op=hvd.Sum) for g in grads]:
            hvd.synchronize(h)

    started, n = time.perf_counter(), 0
    while engine.tuner is not None and n < 2000:
        step()
        n += 1
    out: dict = {"tuning_s": time.perf_counter() - started, "tuning_steps": n}
    kept = out["threshold"] = engine.fusion_threshold
    contenders: list[int | str] = [*GRID, "tuned"]
    times: dict[str, list[float]] = {str(c): [] for c in contenders}
    order = random.Random(0)
    for r in range(rounds + 1):  # round 0 warms up
        if r:
            order.shuffle(contenders)
        for c in contenders:
            hvd.barrier()
            engine.fusion_threshold = kept if c == "tuned" else int(c)
            step()
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if r:
                times[str(c)].append((time.perf_counter() - t0) / steps)
    out["times"] = times
    hvd.shutdown()
    return out


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-samples", type=int, default=12)
    parser.add_argument("--steps-per-sample", type=int, default=5)
    args = parser.parse_args()
    tune_env = {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.steps_per_sample),
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.max_samples),
        "HOROVOD_CYCLE_TIME": "1",
    }
    print(f"{args.num_proc} ranks on 127.0.0.1 (gloo), {args.steps} timed steps, "
          f"{args.rounds} rounds; autotune: {args.max_samples} samples x "
          f"{args.steps_per_sample} steps (+1 warm-up sample), cycle time held")  # fmt: skip
    for workload, (count, numel) in WORKLOADS.items():
        r = run_local(_job, num_proc=args.num_proc, args=(workload, args.steps, args.rounds),
                      env=tune_env, backend="gloo")[0]  # fmt: skip
        times = r["times"]
        mib = count * numel * 4 / 2**20
        print(f"\n{workload}: {count} x {numel * 4 // 1024} KiB = {mib:g} MiB a step")
        med = {c: statistics.median(v) for c, v in times.items()}
        for c, s in med.items():
            label = f"tuned ({r['threshold'] / 2**20:.3f} MiB)" if c == "tuned" else (
                f"grid {int(c) / 2**20:.3f} MiB")  # fmt: skip
            print(f"  {label:22s}: {s * 1e3:8.2f} ms/step ({mib / s:8.1f} MiB/s)")
        best = min((c for c in med if c != "tuned"), key=lambda c: med[c])
        paired = statistics.median(b / t for b, t in zip(times[best], times["tuned"], strict=True))
        print(f"  tuned / best grid ({int(best) / 2**20:g} MiB) throughput: {paired:5.3f}x "
              f"paired, {med[best] / med['tuned']:5.3f}x medians (target >= 0.95x)")  # fmt: skip
        cost = r["tuning_s"] - r["tuning_steps"] * med[best]
        print(f"  tuning phase: {r['tuning_steps']} steps in {r['tuning_s']:6.2f} s; at the best "
              f"grid point they take {r['tuning_steps'] * med[best]:6.2f} s "
              f"(cost {cost:+.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
