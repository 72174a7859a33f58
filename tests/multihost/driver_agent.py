"""The Spark driver of the multi-host harness, run inside the driver host (netns.DriverAgent).

It builds one SparkSession against the harness's standalone Master, waits for the three
executors, answers ``READY`` and then runs one scenario per JSON line read on stdin, answering
one JSON line on the pipe named in ``SEMH_AGENT``. The functions the ranks run are defined
here, in ``__main__``, so cloudpickle ships them by value. EOF on stdin stops the session.
"""

import json
import os
import sys
import time
import traceback

CONFIG = json.loads(os.environ["SEMH_AGENT"])
os.environ["SPARK_LOCAL_IP"] = CONFIG["driver"]

from pyspark.sql import SparkSession  # noqa: E402

import spark_estimators  # noqa: E402
from spark_estimators.errors import TrainingFailedError  # noqa: E402

PROGRESS = os.path.join(CONFIG["workdir"], "progress")


def session() -> SparkSession:
    n, cores = CONFIG["executors"], CONFIG["cores"]
    builder = (
        SparkSession.builder.master(CONFIG["master"])
        .appName("spark_estimators-multihost")
        .config("spark.driver.host", CONFIG["driver"])
        .config("spark.driver.bindAddress", CONFIG["driver"])
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.executor.memory", "1g")
        .config("spark.executor.cores", str(cores))
        .config("spark.cores.max", str(n * cores))
        .config("spark.default.parallelism", str(n * cores))
        .config("spark.sql.shuffle.partitions", str(n * cores))
        .config("spark.local.dir", os.path.join(CONFIG["workdir"], "spark-local"))
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.python.worker.reuse", "true")
    )
    for key, value in CONFIG["conf"].items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    deadline = time.monotonic() + 180
    sc = spark.sparkContext
    while sc._jsc.sc().getExecutorMemoryStatus().size() < n + 1:  # + the driver's own
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} executors registered within 180 s")
        time.sleep(0.5)  # waiting for the Workers' executor JVMs, not for our own threads
    return spark


# -- what the ranks run ------------------------------------------------------------------------
def layout_and_ops() -> dict:
    """Topology, op results and this rank's TCP sockets, from inside one rank."""
    import socket

    import psutil
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    even, odd = hvd.ProcessSet([0, 2, 4]), hvd.ProcessSet([1, 3, 5])
    hvd.init(process_sets=[even, odd])
    r, n = hvd.rank(), hvd.size()
    backend = eng.current().backend
    mine = even if r % 2 == 0 else odd
    out = {
        "rank": r,
        "size": n,
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "hostname": socket.gethostname(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "SPARK_EST"))},
        "addresses": sorted(
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET
        ),
        "mesh": getattr(backend, "_mesh", None) is not None,
        "backend": hvd.backend_name(),
        "allreduce": hvd.allreduce(torch.arange(4.0) * (r + 1), op=hvd.Sum).tolist(),
        "allreduce_big": float(hvd.allreduce(torch.full((100_000,), float(r)))[0]),
        "allgather": hvd.allgather(torch.tensor([[r, 10 * r]])).tolist(),
        "broadcast": hvd.broadcast(torch.tensor([r + 0.5]), root_rank=n - 1).tolist(),
        "alltoall": hvd.alltoall(torch.tensor([[100 * r + j] for j in range(n)])).tolist(),
        "set_allreduce": hvd.allreduce(
            torch.tensor([float(r + 1)]), op=hvd.Sum, process_set=mine
        ).tolist(),
        "set_allgather": hvd.allgather(torch.tensor([r]), process_set=mine).tolist(),
        "hosts": hvd.allgather_object(socket.gethostname()),
    }
    # Gloo opens its pairwise TCP connections at init; list them while the group is up.
    conns = psutil.Process().net_connections(kind="tcp")
    out["listen"] = [list(c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    out["established"] = [
        [*c.laddr, *c.raddr] for c in conns if c.status == psutil.CONN_ESTABLISHED and c.raddr
    ]
    hvd.barrier()
    hvd.shutdown()
    return out


def allreduce_until_cut(progress: str) -> int:
    """Allreduce in a loop, writing the step count to ``progress/<rank>``, until it fails."""
    import socket

    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    step = 0
    while True:
        hvd.allreduce(np.ones(1000, np.float32), op=hvd.Sum, name=f"s{step % 4}")
        step += 1
        if step % 20 == 0:
            with open(os.path.join(progress, str(hvd.rank())), "w") as f:
                f.write(f"{step} {socket.gethostname()}\n")


ELASTIC_N, ELASTIC_EPOCHS, ELASTIC_BATCH, HOLD_STEP = 1152, 3, 16, 5


def elastic_train(folder: str) -> dict:
    """Elastic linear regression; at step HOLD_STEP every rank waits for ``folder/killed``.

    Every processed sample is counted in the committed state, so after the survivors recover
    each sample must have been counted exactly ELASTIC_EPOCHS times.
    """
    import socket

    import numpy as np
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.torch import elastic

    hvd.init()
    n, batch = ELASTIC_N, ELASTIC_BATCH
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(n, 3)).astype(np.float32))
    y = x @ torch.tensor([1.5, -2.0, 0.5]) + 0.25
    torch.manual_seed(hvd.rank())  # different on purpose: sync() must make them equal
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model, opt, epoch=0, offset=0, step=0, seen=np.zeros(n, np.int64))
    resets: list = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    killed = os.path.join(folder, "killed")

    @elastic.run
    def loop(state):
        while state.epoch < ELASTIC_EPOCHS:
            perm = np.random.default_rng(state.epoch).permutation(n)
            while state.offset < n:
                size, rank = hvd.size(), hvd.rank()
                chunk = perm[state.offset : state.offset + batch * size]
                mine = chunk[rank::size]
                opt.zero_grad()
                loss = ((model(x[mine]).squeeze(1) - y[mine]) ** 2).sum() / len(chunk)
                loss.backward()
                for i, p in enumerate(model.parameters()):
                    hvd.allreduce_(p.grad, op=hvd.Sum, name=f"grad{i}")
                opt.step()
                counted = hvd.allgather(torch.from_numpy(np.ascontiguousarray(mine)), name="ids")
                np.add.at(state.seen, counted.numpy(), 1)
                state.offset += len(chunk)
                state.step += 1
                if state.step % 2 == 0:
                    state.commit()
                if state.step == HOLD_STEP and not os.path.exists(killed):
                    with open(os.path.join(folder, str(rank)), "w") as f:
                        f.write(f"{state.step} {socket.gethostname()}\n")
                    deadline = time.monotonic() + 180
                    while not os.path.exists(killed) and time.monotonic() < deadline:
                        time.sleep(0.2)  # the test kills a host, then writes the file
            state.epoch += 1
            state.offset = 0
            state.commit()
        with torch.no_grad():
            mse = float(((model(x).squeeze(1) - y) ** 2).mean())
        return {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "host": socket.gethostname(),
            "seen": sorted(set(state.seen.tolist())),
            "steps": state.step,
            "weights": model.weight.detach().numpy().ravel().tolist(),
            "mse": mse,
            "resets": resets,
        }

    return loop(state)


# -- scenarios (driver side) ------------------------------------------------------------------
def scenario_layout(spark: SparkSession) -> dict:
    return {"ranks": spark_estimators.run(layout_and_ops, num_proc=6, spark=spark, verbose=0)}


def scenario_cut(spark: SparkSession, timeout: float) -> dict:
    os.makedirs(PROGRESS, exist_ok=True)
    env = {"SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": str(timeout)}
    try:
        spark_estimators.run(
            allreduce_until_cut, args=(PROGRESS,), num_proc=6, spark=spark, env=env, verbose=0
        )
    except TrainingFailedError as exc:
        return {
            "failed_at": time.time(),
            "message": str(exc),
            "failures": {
                str(r): {"host": e.host, "message": e.message}
                for r, e in exc.worker_failures.items()
            },
        }
    return {"failed_at": None}


def scenario_elastic(spark: SparkSession) -> dict:
    from spark_estimators.elastic import run_elastic

    folder = os.path.join(CONFIG["workdir"], "elastic")
    os.makedirs(folder, exist_ok=True)
    started = time.time()
    # Survivors whose ring peers went to the reset first wait for the collective timeout
    # before they join it: elastic_timeout must exceed it (docs/clusters.md).
    results = run_elastic(
        elastic_train, args=(folder,), num_proc=6, min_num_proc=4, reset_limit=3,
        start_timeout=120, elastic_timeout=60, spark=spark, verbose=0,
        env={"SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": "20"},
    )  # fmt: skip
    return {"results": results, "seconds": time.time() - started}


def hostname() -> str:
    import socket

    return socket.gethostname()


def scenario_unreachable(spark: SparkSession, address: str, start_timeout: float) -> dict:
    """A run whose driver service (at ``address``) one host cannot reach."""
    started = time.time()
    try:
        spark_estimators.run(
            hostname, num_proc=6, spark=spark, driver_host=address,
            start_timeout=start_timeout, verbose=0,
        )  # fmt: skip
    except Exception as exc:
        return {"seconds": time.time() - started, "type": type(exc).__name__, "message": str(exc)}
    return {"seconds": time.time() - started, "type": None}


def scenario_torch_fit(spark: SparkSession, data: str) -> dict:
    import numpy as np
    import torch
    from pyspark.ml.linalg import Vectors

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(y))]
    df = spark.createDataFrame(rows, ["features", "y"]).repartition(6)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    est = TorchEstimator(
        num_proc=6,
        store=LocalStore(os.path.join(CONFIG["workdir"], "store")) if data == "parquet" else None,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=20,
        epochs=4,
        random_seed=1,
        verbose=0,
        data=data,
    )
    fitted = est.fit(df)
    pred = fitted.transform(df).select("y", "y__output").collect()
    weights = fitted.getModel().weight.detach().numpy().ravel().tolist()
    return {
        "history": [h["loss"] for h in fitted.getHistory()],
        "transform_rows": len(pred),
        "transform_mse": float(np.mean([(r["y"] - r["y__output"]) ** 2 for r in pred])),
        "weights": weights,
    }


SCENARIOS = {
    "layout": scenario_layout,
    "cut": scenario_cut,
    "torch_fit": scenario_torch_fit,
    "unreachable": scenario_unreachable,
    "elastic": scenario_elastic,
}


def main() -> None:
    answers = os.fdopen(CONFIG["result_fd"], "w")

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    spark = session()
    try:
        answer({"ready": True, "pid": os.getpid()})
        for line in sys.stdin:
            request = json.loads(line)
            try:
                result = SCENARIOS[request["scenario"]](spark, **request["kwargs"])
            except Exception as exc:  # the test asserts on it; the agent keeps serving
                result = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
            answer(result)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
