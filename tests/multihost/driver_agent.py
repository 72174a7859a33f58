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
# The first run of the session waits for six cold Python workers on a shared machine (over
# 60 s at a load of 15): the scenarios that set no start_timeout of their own get 180 s.
os.environ.setdefault("SPARK_ESTIMATORS_START_TIMEOUT", "180")

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


def mpi_ops() -> dict:
    """Inside an MPI rank (run(backend="mpi")): topology, MPI's own view, exact results."""
    import socket

    import numpy as np
    from mpi4py import MPI

    import spark_estimators.collective as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    world = MPI.COMM_WORLD
    # MPI's shared-memory split: the ranks MPICH's process mapping puts on this node.
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    out = {
        "rank": r,
        "size": n,
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_size": hvd.cross_size(),
        "backend": hvd.backend_name(),
        "world": [world.Get_rank(), world.Get_size()],
        "node_size": node.Get_size(),
        "hostname": socket.gethostname(),
        "allreduce": hvd.allreduce(np.arange(4.0) * (r + 1), op=hvd.Sum).tolist(),
        "allreduce_big": float(
            hvd.allreduce(np.full(1_000_000, float(r), np.float32), op=hvd.Sum)[-1]
        ),
        "allgather": hvd.allgather(np.array([[r, 10 * r]])).tolist(),
        "broadcast": hvd.broadcast(np.array([r + 0.5]), root_rank=n - 1).tolist(),
        "raw_allreduce": world.allreduce(r + 1),
    }
    node.Free()
    hvd.shutdown()
    return out


# -- scenarios (driver side) ------------------------------------------------------------------
def scenario_layout(spark: SparkSession) -> dict:
    return {"ranks": spark_estimators.run(layout_and_ops, num_proc=6, spark=spark, verbose=0)}


def scenario_mpi(spark: SparkSession) -> dict:
    ranks = spark_estimators.run(mpi_ops, num_proc=6, spark=spark, backend="mpi", verbose=0)
    return {"ranks": ranks}


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
    # before they join it; the reset waits for them that long although elastic_timeout is
    # shorter (elastic/service.py; before, the job aborted with "only 2 worker(s)").
    results = run_elastic(
        elastic_train, args=(folder,), num_proc=6, min_num_proc=4, reset_limit=3,
        start_timeout=120, elastic_timeout=10, spark=spark, verbose=0,
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


def linear_df(spark: SparkSession):
    """600 rows: ``features`` (3 normal values) and ``y = x @ [1, -2, 0.5] + 0.3``, 6 partitions."""
    import numpy as np
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(y))]
    return spark.createDataFrame(rows, ["features", "y"]).repartition(6)


def fit_summary(fitted, df, loss_key: str, weights: list) -> dict:
    """What the estimator tests check: loss history, transform error, learned weights."""
    import numpy as np

    rows = fitted.transform(df).select("y", "y__output").collect()
    pred = np.array([np.ravel(r["y__output"])[0] for r in rows], dtype=float)
    target = np.array([r["y"] for r in rows], dtype=float)
    history = fitted.getHistory()
    return {
        "history": [float(h[loss_key]) for h in history],
        "epochs": [h.get("epoch") for h in history],
        "transform_rows": len(rows),
        "transform_mse": float(np.mean((pred - target) ** 2)),
        "weights": [float(w) for w in np.ravel(weights)],
    }


def record_host(folder: str) -> None:
    """Inside a rank: write ``folder/<rank>`` with this host's name (once per process)."""
    import socket

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, os.environ["RANK"]), "w") as f:
        f.write(socket.gethostname())


def hosts_of(folder: str) -> dict:
    """rank -> host name, as the ranks wrote them with record_host."""
    out = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            out[name] = f.read()
    return out


def scenario_torch_fit(spark: SparkSession, data: str) -> dict:
    import numpy as np
    import torch

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    df = linear_df(spark)
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


def _store(data: str, name: str):
    from spark_estimators.store import LocalStore

    return LocalStore(os.path.join(CONFIG["workdir"], name)) if data == "parquet" else None


def scenario_lightning_fit(spark: SparkSession, data: str) -> dict:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    from spark_estimators.lightning import LightningEstimator

    folder = os.path.join(CONFIG["workdir"], f"hosts-lightning-{data}")

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.fc(x)

        def on_train_start(self):
            record_host(folder)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            # Lightning's estimator scales no rate: the 6-rank rate is given as it is.
            return torch.optim.SGD(self.parameters(), lr=0.3)

    df = linear_df(spark)
    torch.manual_seed(0)
    est = LightningEstimator(
        num_proc=6, store=_store(data, "store-lightning"), model=Linear(),
        feature_cols=["features"], label_cols=["y"], batch_size=20, epochs=4,
        random_seed=1, verbose=0, data=data,
    )  # fmt: skip
    fitted = est.fit(df)
    weights = fitted.getModel().fc.weight.detach().numpy()
    return {**fit_summary(fitted, df, "train_loss", weights), "hosts": hosts_of(folder)}


def scenario_keras_fit(spark: SparkSession, data: str) -> dict:
    import keras

    from spark_estimators.keras import KerasEstimator

    folder = os.path.join(CONFIG["workdir"], f"hosts-keras-{data}")

    class HostFile(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            record_host(folder)

    df = linear_df(spark)
    keras.utils.set_random_seed(0)
    est = KerasEstimator(
        num_proc=6, store=_store(data, "store-keras"),
        model=keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        optimizer=keras.optimizers.SGD(0.05), loss="mse", callbacks=[HostFile()],
        feature_cols=["features"], label_cols=["y"], batch_size=20, epochs=4,
        random_seed=1, verbose=0, data=data,
    )  # fmt: skip
    fitted = est.fit(df)
    weights = fitted.getModel().layers[0].get_weights()[0]
    return {**fit_summary(fitted, df, "loss", weights), "hosts": hosts_of(folder)}


ELASTIC_FIT_HOLD = 8  # the 8th training batch of a rank: epoch 1 (of 0..3), 5 batches an epoch


def scenario_torch_elastic_fit(spark: SparkSession) -> dict:
    """An elastic TorchEstimator fit on 6 ranks; every rank waits at its 8th training batch.

    The test kills one host meanwhile (then writes ``killed``): the fit must relaunch from the
    epoch-0 checkpoint on the 4 survivors' slots and finish.
    """
    import logging

    import torch

    from spark_estimators.core.checkpoint import read_info
    from spark_estimators.torch import TorchEstimator

    folder = os.path.join(CONFIG["workdir"], "elastic-fit")
    killed = os.path.join(folder, "killed")

    class HoldingLinear(torch.nn.Linear):
        """A Linear layer whose ranks record their host and wait for the test at one batch."""

        calls = 0

        def forward(self, x):
            if self.training and "RANK" in os.environ and not os.path.exists(killed):
                self.calls += 1
                if self.calls == ELASTIC_FIT_HOLD:
                    record_host(folder)
                    deadline = time.monotonic() + 180
                    while not os.path.exists(killed) and time.monotonic() < deadline:
                        time.sleep(0.2)  # the test kills a host, then writes the file
            return super().forward(x)

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    relaunch_log = logging.getLogger("spark_estimators.core.relaunch")
    handler = Collect(logging.WARNING)
    relaunch_log.addHandler(handler)
    df = linear_df(spark)
    torch.manual_seed(0)
    model = HoldingLinear(3, 1)
    store = _store("parquet", "store-elastic")
    est = TorchEstimator(
        num_proc=6, min_num_proc=4, elastic=True, reset_limit=2, store=store,
        run_id="elastic_fit", model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss=torch.nn.MSELoss(),
        feature_cols=["features"], label_cols=["y"], batch_size=20, epochs=4,
        random_seed=1, verbose=0,
    )  # fmt: skip
    started = time.time()
    try:
        fitted = est.fit(df)
    finally:
        relaunch_log.removeHandler(handler)
    weights = fitted.getModel().weight.detach().numpy()
    info = read_info(store, "elastic_fit", "torch")
    return {
        **fit_summary(fitted, df, "loss", weights),
        "seconds": time.time() - started,
        "relaunches": warnings,
        "checkpoint_epoch": None if info is None else info.epoch,
        "checkpoint_num_proc": None if info is None else info.num_proc,
    }


def scenario_executors(spark: SparkSession, count: int, wait_s: float) -> dict:
    """Wait until ``count`` executors are registered; their hosts."""
    sc = spark.sparkContext
    deadline = time.monotonic() + wait_s
    while True:
        hosts = sorted(e.host() for e in sc._jsc.sc().statusTracker().getExecutorInfos())
        if len(hosts) >= count + 1 or time.monotonic() > deadline:  # + the driver's own
            return {"hosts": [h for h in hosts if h != CONFIG["driver"]]}
        time.sleep(0.5)  # the Master starting an executor on a Worker, another process


def scenario_call(spark: SparkSession, path: str, function: str, kwargs: dict) -> dict:
    """Run ``function(spark, **kwargs)`` of the Python file ``path`` (benchmarks, other tests).

    The file's module is pickled by value, so its functions reach the ranks as this file's do.
    """
    import importlib.util

    import cloudpickle

    name = "semh_" + os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cloudpickle.register_pickle_by_value(module)
    return dict(getattr(module, function)(spark, **kwargs))


SCENARIOS = {
    "layout": scenario_layout,
    "mpi": scenario_mpi,
    "cut": scenario_cut,
    "torch_fit": scenario_torch_fit,
    "lightning_fit": scenario_lightning_fit,
    "keras_fit": scenario_keras_fit,
    "torch_elastic_fit": scenario_torch_elastic_fit,
    "executors": scenario_executors,
    "call": scenario_call,
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
