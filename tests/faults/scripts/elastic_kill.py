"""Run in its own process: run_elastic on a local[2,4] session (4 attempts per task).

Scenario "kill": 2 ranks train a linear model with ``TorchState``; rank 1 SIGKILLs itself once
at step ``kill_step``. Every processed sample is counted in the committed state, so after
recovery each sample must have been counted exactly ``EPOCHS`` times.
Scenario "reset_limit": rank 1 dies at every attempt; ``reset_limit=1`` must stop the job.
Prints ``RESULT <json>``.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from spark_estimators.core.session import create_local_session  # noqa: E402
from spark_estimators.elastic import run_elastic  # noqa: E402
from spark_estimators.errors import ElasticResetLimitError  # noqa: E402

N, EPOCHS, BATCH = 384, 4, 16  # per-rank batch; 12 steps per epoch with 2 ranks
TRUE_W = [1.5, -2.0, 0.5]


def train(marker, kill_step, always_kill=False):
    import os
    import signal
    import time

    import numpy as np
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.torch import elastic

    hvd.init()
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(N, 3)).astype(np.float32))
    y = x @ torch.tensor(TRUE_W) + 0.25
    torch.manual_seed(hvd.rank())  # different on purpose: sync() must make them equal
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    state = elastic.TorchState(model, opt, epoch=0, offset=0, step=0, seen=np.zeros(N, np.int64))
    resets = []
    state.register_reset_callbacks([lambda: resets.append((hvd.size(), time.time()))])

    @elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            perm = np.random.default_rng(state.epoch).permutation(N)
            while state.offset < N:
                size, rank = hvd.size(), hvd.rank()
                chunk = perm[state.offset : state.offset + BATCH * size]
                mine = chunk[rank::size]
                opt.zero_grad()
                pred = model(x[mine]).squeeze(1)
                loss = ((pred - y[mine]) ** 2).sum() / len(chunk)
                loss.backward()
                for i, p in enumerate(model.parameters()):
                    hvd.allreduce_(p.grad, op=hvd.Sum, name=f"grad{i}")
                opt.step()
                counted = hvd.allgather(torch.from_numpy(np.ascontiguousarray(mine)), name="ids")
                np.add.at(state.seen, counted.numpy(), 1)
                state.offset += len(chunk)
                state.step += 1
                if state.step == kill_step and rank == 1:
                    if always_kill or not os.path.exists(marker):
                        with open(marker, "w") as f:
                            f.write(repr(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)
                if state.step % 3 == 0:
                    state.commit()
            state.epoch += 1
            state.offset = 0
            state.commit()
        with torch.no_grad():
            mse = float(((model(x).squeeze(1) - y) ** 2).mean())
        return {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "seen": state.seen.tolist(),
            "steps": state.step,
            "weights": model.weight.detach().numpy().ravel().tolist(),
            "mse": mse,
            "resets": resets,
            "pid": os.getpid(),
        }

    return loop(state)


def main() -> None:
    spark = create_local_session("local[2,4]")
    tmp = tempfile.mkdtemp(prefix="se-elastic-")
    kill_step = int(sys.argv[1])
    result = {"kill_step": kill_step}

    marker = os.path.join(tmp, "killed")
    started = time.time()
    results = run_elastic(
        train, args=(marker, kill_step), num_proc=2, min_num_proc=1, reset_limit=3,
        start_timeout=240, elastic_timeout=120, spark=spark, verbose=0,
    )  # fmt: skip
    result["kill"] = {
        "results": results,
        "killed_at": float(open(marker).read()) if os.path.exists(marker) else None,
        "seconds": time.time() - started,
    }

    marker2 = os.path.join(tmp, "killed-always")
    started = time.time()
    try:
        run_elastic(
            train, args=(marker2, 2, True), num_proc=2, min_num_proc=2, reset_limit=1,
            start_timeout=240, elastic_timeout=120, spark=spark, verbose=0,
        )  # fmt: skip
        result["reset_limit"] = {"error": None}
    except ElasticResetLimitError as exc:
        result["reset_limit"] = {
            "error": type(exc).__name__,
            "message": str(exc),
            "failures": len(exc.worker_failures),
            "seconds": time.time() - started,
        }
    print("RESULT " + json.dumps(result), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
