"""The physical floor of a fit preset: plain torch over one rank's rows in memory (issue 45).

Each of ``ranks`` worker processes (spawned once, reused every round) holds one rank's share of
the preset's rows as float32 tensors (the same distribution as bench/fit.py's DataFrame: uniform
features, ``y`` linear in them), runs torch with 1 thread, and trains the preset's MLP with Adam
(lr 1e-3), MSE and batch 256 for the preset's epochs: a new permutation of its rows per epoch,
then contiguous slices. No reader, no collective, no hooks, no metrics. The workers start their
loops together (a barrier), so both ranks' worth runs in parallel on the 2 cores as the fit's
ranks do. Reported per round: the floor (the slower worker's loop, seconds), and its per-step
time (the median of the step intervals, ms), the figure a fit's own step is compared with, and
its CPU time per step (``cpu_step_ms``, the workers' mean; on a loaded machine the steadier one).

    .venv/bin/python bench/floor.py --preset large --rounds 3   # the floor alone
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

BATCH = 256
_BARRIER: Any = None


def _init(barrier: Any) -> None:
    global _BARRIER
    _BARRIER = barrier
    import torch

    torch.set_num_threads(1)


def step_times(stamps: list[float], skip: int = 20) -> list[float]:
    """Intervals between consecutive step ends (seconds), after the first ``skip`` steps."""
    return [b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False)]


PARTS = ("forward + loss", "backward", "optimizer")


def _worker(task: tuple[int, int, int, list[int], int, int, bool]) -> dict[str, Any]:
    """One rank's share: data built, barrier, the timed loop (``parts``: a clock between parts)."""
    import torch

    rank, rows, nf, hidden, epochs, batch, parts = task
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.rand(rows, nf, generator=gen)
    y = (x * torch.arange(1, nf + 1, dtype=torch.float32)).sum(1, keepdim=True) / nf
    torch.manual_seed(0)
    layers: list[Any] = []
    prev = nf
    for h in hidden:
        layers += [torch.nn.Linear(prev, h), torch.nn.ReLU()]
        prev = h
    model = torch.nn.Sequential(*layers, torch.nn.Linear(prev, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    _BARRIER.wait()
    stamps: list[float] = []
    times: list[tuple[float, float, float]] = []
    clock = time.perf_counter
    t0, cpu0 = time.perf_counter(), time.process_time()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for _ in range(epochs):
        perm = torch.randperm(rows, generator=gen)
        xs, ys = x[perm], y[perm]
        for start in range(0, rows, batch):
            xb, yb = xs[start : start + batch], ys[start : start + batch]
            if parts:  # the same loop with a clock between the parts (step_profile --breakdown)
                a = clock()
                opt.zero_grad()
                loss = loss_fn(model(xb), yb)
                b = clock()
                loss.backward()
                c = clock()
                opt.step()
                times.append((b - a, c - b, clock() - c))
            else:
                opt.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                opt.step()
            loss_sum += loss.detach().to(torch.float64) * len(xb)
            stamps.append(time.perf_counter())
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    float(loss_sum)
    out: dict[str, Any] = {}
    if parts:
        out["parts"] = {
            p: 1e3 * statistics.median(t[i] for t in times[20:]) for i, p in enumerate(PARTS)
        }
    return {
        **out,
        "loop_s": total,
        "steps": len(stamps),
        "step_ms": 1e3 * statistics.median(step_times(stamps)),
        "mean_step_ms": 1e3 * total / max(len(stamps), 1),
        "cpu_step_ms": 1e3 * cpu / max(len(stamps), 1),
    }


class Floor:
    """``ranks`` spawned workers; :meth:`measure` runs one floor round of a preset."""

    def __init__(self, ranks: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.ranks = ranks
        self.pool = ctx.Pool(ranks, initializer=_init, initargs=(ctx.Barrier(ranks),))

    def measure(
        self, cfg: dict[str, Any], batch: int = BATCH, parts: bool = False
    ) -> dict[str, Any]:
        """One round; ``parts``: also worker 0's median ms of each of :data:`PARTS`."""
        share = cfg["rows"] // self.ranks
        tasks = [
            (rank, share, cfg["features"], list(cfg["hidden"]), cfg["epochs"], batch, parts)
            for rank in range(self.ranks)
        ]
        # chunksize 1 and a barrier in each task: each worker takes exactly one rank
        out = self.pool.map(_worker, tasks, chunksize=1)
        slow = max(out, key=lambda r: r["loop_s"])
        extra = {"parts": out[0]["parts"]} if parts else {}
        return {
            **extra,
            "total_s": slow["loop_s"],
            "step_ms": statistics.median(r["step_ms"] for r in out),
            "mean_step_ms": slow["mean_step_ms"],
            "steps": slow["steps"],
            "cpu_step_ms": statistics.mean(r["cpu_step_ms"] for r in out),
        }

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def main() -> None:
    from fit import PRESETS

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int)
    args = parser.parse_args()
    cfg = dict(PRESETS[args.preset])
    if args.rows:
        cfg["rows"] = args.rows
    floor = Floor()
    for rnd in range(1, args.rounds + 1):
        r = floor.measure(cfg)
        print(
            f"round {rnd}: floor {r['total_s']:.3f} s, {r['steps']} steps, step median "
            f"{r['step_ms']:.3f} ms, mean {r['mean_step_ms']:.3f} ms",
            flush=True,
        )
    floor.close()


if __name__ == "__main__":
    main()
