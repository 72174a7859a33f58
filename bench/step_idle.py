"""Does a CPU that waits between steps compute the next step slower? (issue 45)

    flock /tmp/bench.lock .venv/bin/python bench/step_idle.py --rounds 3

One process, 1 torch thread, the large preset's MLP 32-128-64-1, Adam lr 1e-3, MSE, batch 256,
data in memory. Cases, in order per round: ``none`` (steps back to back, as bench/floor.py),
``sleep`` (after each step a ``select`` of ``--wait-us`` microseconds: the thread sleeps as a
fit's rank does while it waits for its peer in the gradient allreduce), ``spin`` (the same wait
spent busy), ``sleep``, ``none``. Printed: the medians (steps 101..) of forward + loss, backward,
optimizer and their sum, in microseconds; the waits themselves are not timed.
"""

from __future__ import annotations

import argparse
import select
import statistics
import time


def case(wait: str, steps: int, wait_s: float) -> list[float]:
    """Median forward + loss, backward, optimizer and their sum (us) of ``steps`` steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.rand(256, 32), torch.rand(256, 1)
    loss_fn, clock, times = torch.nn.MSELoss(), time.perf_counter, []
    for _ in range(steps):
        a = clock()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        b = clock()
        loss.backward()
        c = clock()
        opt.step()
        d = clock()
        times.append((b - a, c - b, d - c, d - a))
        if wait == "sleep":
            select.select([], [], [], wait_s)
        elif wait == "spin":
            while clock() < d + wait_s:
                pass
    return [1e6 * statistics.median(t[i] for t in times[100:]) for i in range(4)]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait-us", type=float, default=400.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for rnd in range(1, args.rounds + 1):
        for wait in ("none", "sleep", "spin", "sleep", "none"):
            fwd, bwd, opt, total = case(wait, args.steps, args.wait_us / 1e6)
            print(
                f"round {rnd} {wait:5s}: forward + loss {fwd:.1f}, backward {bwd:.1f}, "
                f"optimizer {opt:.1f}, step {total:.1f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
