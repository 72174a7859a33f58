"""horovod 0.28.1's side of bench/allreduce.py's 100 x 4 KiB cases (issue 45).

Run by the python of a separate horovod virtualenv (recipe in bench/README.md), never by the
project's: horovod 0.28.1 cannot share a virtualenv with ours. ``bench/allreduce.py
--horovod-python PATH`` runs it and prints its medians beside ours; it also runs alone:

    /work/venv-hvd/bin/python bench/allreduce_horovod.py --repeats 10

Two ranks on this host over Gloo (``horovod.run(..., hosts="localhost:2", use_gloo=True)``, what
``horovodrun -np 2 -H localhost:2 --gloo`` starts), the same cases as ours, each preceded by
``hvd.barrier()``, in a shuffled order per round (round 0 warms up):

* ``100x4KiB horovod per tensor, async``: 100 ``hvd.allreduce_async_(t, op=hvd.Sum)`` then
  ``hvd.synchronize`` on each handle (horovod's background thread fuses them);
* ``100x4KiB horovod fused (grouped_allreduce_)``: ``hvd.grouped_allreduce_(small, op=hvd.Sum)``.

Prints one line ``RESULT {json}``: rank 0's seconds per round of each case.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

SMALL_COUNT, SMALL_ELEMENTS = 100, 1024  # 100 x 4 KiB, as bench/allreduce.py
ASYNC = "100x4KiB horovod per tensor, async"
GROUPED = "100x4KiB horovod fused (grouped_allreduce_)"


def _bench(repeats: int) -> dict[str, list[float]]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    small = [torch.ones(SMALL_ELEMENTS) for _ in range(SMALL_COUNT)]

    def per_tensor_async() -> None:
        for h in [hvd.allreduce_async_(t, op=hvd.Sum) for t in small]:
            hvd.synchronize(h)

    cases = {
        ASYNC: per_tensor_async,
        GROUPED: lambda: hvd.grouped_allreduce_(small, op=hvd.Sum),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = random.Random(0)  # the same sequence on every rank
    for round_ in range(repeats + 1):  # round 0 warms up
        names = list(cases)
        if round_:
            order.shuffle(names)
        for name in names:
            for t in small:  # untimed: keep the sums finite round after round
                t.fill_(1.0)
            hvd.barrier()
            started = time.perf_counter()
            cases[name]()
            elapsed = time.perf_counter() - started
            if round_:
                times[name].append(elapsed)
    assert float(small[0][0]) == 2.0, "the last op did not sum over 2 ranks"
    hvd.shutdown()
    return times


def run(repeats: int, num_proc: int = 2) -> dict[str, Any]:
    """Rank 0's seconds per round of each case, from one horovod.run job."""
    import horovod

    results = horovod.run(
        _bench, args=(repeats,), np=num_proc, hosts=f"localhost:{num_proc}", use_gloo=True
    )
    return results[0]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args()
    print("RESULT " + json.dumps(run(args.repeats, args.num_proc)), flush=True)


if __name__ == "__main__":
    main()
