"""Run in its own process: two TorchEstimator fits at once in one local[4] SparkSession.

The fits share the store but have different run_ids, different DataFrames (different true
weights) and 2 ranks each. Every rank records its rendezvous port and its driver-service peer.
Prints ``RESULT <json>`` with what the test checks: each model learned its own data, each run's
checkpoint holds its own weights, and the two fits used different ports.
"""

import io
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.core.checkpoint import read_info  # noqa: E402
from spark_estimators.core.session import create_local_session  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402
from spark_estimators.torch.remote import checkpoint_paths  # noqa: E402

WEIGHTS = {"fit_a": [1.0, 2.0, -3.0], "fit_b": [-2.0, 0.5, 4.0]}


class RecordPorts:
    """Callback: every rank writes its MASTER_PORT and driver port into ``out_dir``."""

    def __init__(self, out_dir, tag):
        self.out_dir, self.tag = out_dir, tag

    def on_train_begin(self, logs):
        import json
        import os

        from spark_estimators.task import context

        info = {
            "master_port": int(os.environ["MASTER_PORT"]),
            "driver_port": int(context._client.address[1]),
            "rank": int(os.environ["RANK"]),
        }
        with open(os.path.join(self.out_dir, f"{self.tag}-{info['rank']}.json"), "w") as f:
            json.dump(info, f)


def make_df(spark, weights, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(256, 3))
    y = x @ np.array(weights)
    rows = [(Vectors.dense(x[i].tolist()), float(y[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, ["features", "y"])


def fit(spark, store, run_id, out_dir, box):
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        est = TorchEstimator(
            num_proc=2,
            store=store,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
            loss=torch.nn.MSELoss(),
            feature_cols=["features"],
            label_cols=["y"],
            batch_size=16,
            epochs=6,
            run_id=run_id,
            callbacks=[RecordPorts(out_dir, run_id)],
            start_timeout=240,
            verbose=0,
        )
        seed = 1 if run_id == "fit_a" else 2
        box[run_id] = est.fit(make_df(spark, WEIGHTS[run_id], seed))
    except BaseException as exc:  # reported in the RESULT line
        box[run_id + "_error"] = repr(exc)


def main() -> None:
    spark = create_local_session("local[4]", spark__default__parallelism="4")
    out_dir = tempfile.mkdtemp(prefix="se-ports-")
    store = LocalStore(tempfile.mkdtemp(prefix="se-concurrent-"))
    box: dict = {}
    started = time.monotonic()
    threads = [
        threading.Thread(target=fit, args=(spark, store, run_id, out_dir, box))
        for run_id in WEIGHTS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result: dict = {"seconds": time.monotonic() - started, "errors": {}}
    for run_id in WEIGHTS:
        if run_id + "_error" in box:
            result["errors"][run_id] = box[run_id + "_error"]
            continue
        model = box[run_id]
        ckpt, _ = checkpoint_paths(store, run_id)
        saved = torch.load(io.BytesIO(store.read_bytes(ckpt)), weights_only=False)
        ports = [json.load(open(os.path.join(out_dir, f"{run_id}-{r}.json"))) for r in range(2)]
        result[run_id] = {
            "weights": model.getModel().weight.detach().numpy().ravel().tolist(),
            "checkpoint_weights": saved["model"]["weight"].numpy().ravel().tolist(),
            "checkpoint_epoch": int(saved["epoch"]),
            "info_epochs": [h["epoch"] for h in read_info(store, run_id).history],
            "history_epochs": [h["epoch"] for h in model.getHistory()],
            "master_ports": sorted({p["master_port"] for p in ports}),
            "driver_ports": sorted({p["driver_port"] for p in ports}),
        }
    result["datasets"] = store.list_datasets()
    print("RESULT " + json.dumps(result), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
