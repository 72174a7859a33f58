"""Run in its own process: a real Spark standalone cluster (Master + 2 Workers, 1 core each,
started with the pyspark wheel's bin/spark-class), run(fn) and a 2-rank TorchEstimator fit across
the two executor JVMs. Every server is stopped by its own PID. Prints ``RESULT <json>``.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np  # noqa: E402
import pyspark  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

import spark_estimators  # noqa: E402

SPARK_HOME = pathlib.Path(pyspark.__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)  # polling a server's port, not synchronising our own threads
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def where(salted_host: str) -> dict:
    import os

    return {"rank": int(os.environ["RANK"]), "host": os.environ["SPARK_ESTIMATORS_HOSTNAME"]}


def fit(spark, workdir: str, data: str = "parquet") -> dict:
    import torch
    from pyspark.ml.linalg import Vectors

    from spark_estimators.store import LocalStore
    from spark_estimators.torch import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    df = spark.createDataFrame(
        [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(y))], ["features", "y"]
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    est = TorchEstimator(
        num_proc=2,
        # data="stream" with no store: the ranks read the DataFrame from their Spark tasks
        store=LocalStore(os.path.join(workdir, "store")) if data == "parquet" else None,
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
    err = float(np.mean([(r["y"] - r["y__output"]) ** 2 for r in pred]))
    return {"history": [h["loss"] for h in fitted.getHistory()], "transform_mse": err}


def main() -> None:
    workdir = tempfile.mkdtemp(prefix="se-standalone-")
    env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOG_DIR=workdir)
    # Each Worker's executors get their own host-hash salt (a logical host per executor).
    spark_class = [str(SPARK_HOME / "bin" / "spark-class")]
    port = free_port()
    servers: list[subprocess.Popen] = []
    logs = []

    def start(args: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(workdir, name + ".log"), "wb")  # noqa: SIM115
        logs.append(log)
        proc = subprocess.Popen(
            spark_class + args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        servers.append(proc)
        return proc

    result: dict = {}
    spark = None
    try:
        master = start(
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            "master",
        )
        wait_for_port(port, master)
        for i in range(2):
            start(
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    os.path.join(workdir, f"work{i}"),
                    f"spark://127.0.0.1:{port}",
                ],
                f"worker{i}",
            )
        spark = (
            SparkSession.builder.master(f"spark://127.0.0.1:{port}")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.executor.memory", "700m")
            .config("spark.executor.cores", "1")
            .config("spark.cores.max", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.executorEnv.SPARK_ESTIMATORS_HOST_HASH_SALT", "{executor}")
            .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
            .getOrCreate()
        )
        result["ranks"] = spark_estimators.run(
            where, args=("x",), num_proc=2, spark=spark, start_timeout=120
        )
        result["fit"] = fit(spark, workdir)
        result["stream_fit"] = fit(spark, workdir, data="stream")
    finally:
        if spark is not None:
            spark.stop()
        for proc in reversed(servers):
            proc.terminate()
        for proc in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        result["server_pids_alive"] = [p.pid for p in servers if p.poll() is None]
        shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
