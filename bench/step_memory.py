"""The step of 2 ranks with DistributedOptimizer vs plain Adam, data in memory (issue 45).

    flock /tmp/bench.lock .venv/bin/python bench/step_memory.py --steps 1500

No Spark, no reader: 2 rank processes by ``run_local`` (Gloo and the local mesh), 1 torch
thread each, the large preset's MLP 32-128-64-1, Adam lr 1e-3, MSE, batch 256, random rows.
Cases, in order: plain (``torch.optim.Adam``, no collective op), ours (``DistributedOptimizer``),
plain again. Per rank: the medians (steps 51..) of forward + loss, backward, ``synchronize()``
(the gradient allreduce) and the optimizer's step, the mean wall and CPU time per step, and
how many steps DistributedOptimizer's steady state took (collective/torch/steady.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from spark_estimators.launch import run_local


def _body(steps: int, plain: bool) -> dict[str, Any]:
    import contextlib

    import torch

    import spark_estimators.collective.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    opt: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
    if plain:
        sync, skip = (lambda: None), contextlib.nullcontext
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        sync, skip = opt.synchronize, opt.skip_synchronize
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.rand(steps, 256, 32, generator=g)
    y = x.sum(-1, keepdim=True) / 32
    loss_fn, clock, parts = torch.nn.MSELoss(), time.perf_counter, []
    cpu0 = wall0 = 0.0
    for i in range(steps):
        if i == 50:
            cpu0, wall0 = time.process_time(), clock()
        t0 = clock()
        opt.zero_grad()
        loss = loss_fn(model(x[i]), y[i])
        t1 = clock()
        loss.backward()
        t2 = clock()
        sync()
        t3 = clock()
        with skip():
            opt.step()
        parts.append((t1 - t0, t2 - t1, t3 - t2, clock() - t3))
    n = steps - 50
    out = {
        name: 1e3 * statistics.median(p[k] for p in parts[50:])
        for k, name in enumerate(("forward + loss", "backward", "allreduce", "optimizer"))
    }
    out["wall"] = 1e3 * (clock() - wall0) / n
    out["cpu"] = 1e3 * (time.process_time() - cpu0) / n
    steady = getattr(opt, "_se_steady", None)
    out["steady steps"] = getattr(steady, "taken", 0)
    hvd.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    for case, plain in (("plain", True), ("ours", False), ("plain", True)):
        outs = run_local(_body, num_proc=2, args=(args.steps, plain), env={"OMP_NUM_THREADS": "1"})
        for rank, out in enumerate(outs):
            assert isinstance(out, dict)
            print(f"{case} rank {rank}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()
            ) + " (ms)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
