"""Autotune against a grid of fusion thresholds, on two workloads whose best threshold differs.

Usage: .venv/bin/python bench/autotune.py [--num-proc 2] [--steps 40] [--rounds 3]
[--max-samples 12] [--steps-per-sample 5]

Workloads (one training "step" = submit every tensor with ``allreduce_async_``, then
``synchronize`` them all, as DistributedOptimizer does):

* ``many-small``: 256 tensors of 4 KiB (1 MiB a step): fusing them saves rounds, so the best
  threshold is large.
* ``few-large``: 4 tensors of 8 MiB (32 MiB a step): fusing copies them into and out of the
  fusion buffer for no saved round worth it, so a threshold below 8 MiB (no fusion) is best.

For each workload, in one ``run_local`` job per contender (N ranks on 127.0.0.1, gloo): every
grid threshold (``SPARK_ESTIMATORS_FUSION_THRESHOLD`` fixed) runs ``--steps`` timed steps after
a warm-up; the autotune job (``HOROVOD_AUTOTUNE=1``, cycle time held at 1 ms) trains until the
tuner is done (the tuning phase, timed), then the same ``--steps`` timed steps with the setting
it kept. Rounds alternate the contenders; medians over rounds. Prints the tuned throughput
against the best grid point (target >= 0.95x) and the tuning phase's cost: its time, and the
time the same number of steps take at the best grid point.
"""

from __future__ import annotations

import argparse
import statistics
import time

WORKLOADS = {"many-small": (256, 1024), "few-large": (4, 2 * 1024 * 1024)}  # count, float32s
GRID = (0, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 64 * 1024 * 1024)


def _job(workload: str, steps: int, tune: bool) -> dict:
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

    out: dict = {}
    if tune:
        started, n = time.perf_counter(), 0
        while engine.tuner is not None and n < 2000:
            step()
            n += 1
        out["tuning_s"], out["tuning_steps"] = time.perf_counter() - started, n
        out["threshold"] = engine.fusion_threshold
    else:
        for _ in range(5):
            step()
    hvd.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    out["step_s"] = (time.perf_counter() - started) / steps
    hvd.shutdown()
    return out


def main() -> None:
    from spark_estimators.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
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
        grid: dict[int, list[float]] = {t: [] for t in GRID}
        tuned: list[dict] = []
        for _ in range(args.rounds):
            for t in GRID:
                env = {"SPARK_ESTIMATORS_FUSION_THRESHOLD": str(t), "HOROVOD_CYCLE_TIME": "1"}
                r = run_local(_job, num_proc=args.num_proc, args=(workload, args.steps, False),
                              env=env, backend="gloo")[0]  # fmt: skip
                grid[t].append(r["step_s"])
            tuned.append(run_local(_job, num_proc=args.num_proc,
                                   args=(workload, args.steps, True), env=tune_env,
                                   backend="gloo")[0])  # fmt: skip
        mib = count * numel * 4 / 2**20
        print(f"\n{workload}: {count} x {numel * 4 // 1024} KiB = {mib:g} MiB a step")
        med = {t: statistics.median(v) for t, v in grid.items()}
        for t, s in med.items():
            print(f"  grid threshold {t / 2**20:8.3f} MiB: {s * 1e3:8.2f} ms/step "
                  f"({mib / s:8.1f} MiB/s)")  # fmt: skip
        best_t = min(med, key=lambda t: med[t])
        tuned_s = statistics.median(r["step_s"] for r in tuned)
        chosen = [round(r["threshold"] / 2**20, 3) for r in tuned]
        tuning_s = statistics.median(r["tuning_s"] for r in tuned)
        tuning_steps = statistics.median(r["tuning_steps"] for r in tuned)
        print(f"  autotune kept {chosen} MiB (per round): {tuned_s * 1e3:8.2f} ms/step")
        print(f"  tuned / best grid ({best_t / 2**20:g} MiB) throughput: "
              f"{med[best_t] / tuned_s:5.3f}x (target >= 0.95x)")  # fmt: skip
        print(f"  tuning phase: {tuning_steps:g} steps in {tuning_s:6.2f} s; at the best grid "
              f"point they take {tuning_steps * med[best_t]:6.2f} s (cost "
              f"{tuning_s - tuning_steps * med[best_t]:+.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
