"""Each estimator's rank-side training through ``fit_on_parquet`` and ``LocalBackend``, no JVM.

    python tests/gpu/estimators_local.py --device cuda --out /tmp/est   # on a GPU machine
    python tests/gpu/estimators_local.py --device cpu --out /tmp/est    # the same paths on CPU

The Parquet is written here with pyarrow at the store's train/val paths (horovod's
``fit_on_parquet`` contract), so neither Spark's JVM nor a prepared dataset is needed: pyspark's
Python files (its Params) are enough. Each check trains a small model with a BatchNorm and
prints one ``RESULT <json>`` line at the end; every check is also asserted here, so the exit
code says whether all passed.

Checks (``device`` cuda; on cpu the same without autocast dtypes and NCCL):
torch_bf16_nccl
    TorchEstimator, one NCCL rank, ``SyncBatchNorm`` (``collective.torch``), bf16 autocast in a
    horovod-style ``train_minibatch_fn``; each rank records its device and the autocast dtype.
torch_hot_start
    The same ``run_id`` with more epochs: the checkpoint's history is kept, only new epochs run.
torch_fp16_scaler
    fp16 autocast with ``torch.amp.GradScaler`` in ``train_minibatch_fn``.
torch_gloo_shared
    Two Gloo ranks sharing ``cuda:0`` (more ranks than GPUs), identical final weights.
predict
    The fitted module's predictions on the GPU (the Model's executor-side predictor, as a Spark
    task with GPU "0" runs it) equal the CPU's within tolerance.
lightning_bf16
    LightningEstimator, one NCCL rank, ``precision="bf16-mixed"``, ``sync_batchnorm=True``,
    then a hot start on the same ``run_id``; predictions on GPU equal CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

N_FEATURES = 16
TRUE_W = np.linspace(-2.0, 2.0, N_FEATURES)


def write_parquet(store, rows: int = 2048, seed: int = 0) -> np.ndarray:
    """Train (and val) Parquet at the store's un-indexed paths; returns the train features."""
    rng = np.random.default_rng(seed)
    out = None
    for path, n in ((store.get_train_data_path(), rows), (store.get_val_data_path(), rows // 4)):
        x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
        y = (x @ TRUE_W + 0.5).astype(np.float32)
        os.makedirs(path, exist_ok=True)
        table = pa.table(
            {"features": pa.array(list(x), type=pa.list_(pa.float32())), "y": pa.array(y)}
        )
        half = n // 2
        pq.write_table(table.slice(0, half), os.path.join(path, "part-0.parquet"))
        pq.write_table(table.slice(half), os.path.join(path, "part-1.parquet"))
        out = x if out is None else out
    return out


def make_module(sync: bool):
    import torch

    import spark_estimators.collective.torch as hvd

    bn = hvd.SyncBatchNorm(32) if sync else torch.nn.BatchNorm1d(32)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 32), bn, torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )


def minibatch_fn(record_dir: str, dtype_name: str | None, scaler: bool):
    """A horovod-style ``train_minibatch_fn`` with autocast; records device and dtype per rank."""
    held: dict = {}  # the rank's GradScaler (made on the rank, never shipped)

    def fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        import torch

        device = inputs[0].device
        enabled = dtype_name is not None and device.type == "cuda"
        dtype = getattr(torch, dtype_name) if dtype_name else torch.float32
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=enabled):
            outputs, matched = transform_outputs(model(*inputs), labels)
            loss = loss_fn(outputs, matched, sample_weights)
        if scaler and enabled:
            grad_scaler = held.setdefault("scaler", torch.amp.GradScaler("cuda"))
            grad_scaler.scale(loss).backward()
            # horovod's DistributedOptimizer: synchronize() before unscale_, then step without
            # a second synchronize.
            optimizer.synchronize()
            grad_scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            loss.backward()
            optimizer.step()
        rank = os.environ.get("SPARK_ESTIMATORS_RANK", "0")
        path = os.path.join(record_dir, f"rank{rank}.json")
        seen = {"calls": 0}
        if os.path.exists(path):
            with open(path) as f:
                seen = json.load(f)
        seen.update(
            device=str(device),
            current_device=torch.cuda.current_device() if device.type == "cuda" else None,
            output_dtype=str(outputs[0].dtype),
            loss_dtype=str(loss.dtype),
            calls=seen["calls"] + 1,
        )
        with open(path, "w") as f:
            json.dump(seen, f)
        return outputs, loss

    return fn


def ranks_seen(record_dir: str) -> list[dict]:
    names = sorted(n for n in os.listdir(record_dir) if n.startswith("rank"))
    out = []
    for name in names:
        with open(os.path.join(record_dir, name)) as f:
            out.append(json.load(f))
    return out


def torch_estimator(store, backend, module, fn, epochs, run_id):
    import torch

    from spark_estimators.torch import TorchEstimator

    return TorchEstimator(
        store=store,
        backend=backend,
        model=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=64,
        epochs=epochs,
        random_seed=1,
        verbose=0,
        run_id=run_id,
        train_minibatch_fn=fn,
        scale_lr=False,
    )


def predict_on(blob_module, x: np.ndarray, gpu: bool) -> np.ndarray:
    """The Model's executor-side predictor, as a Spark task with (or without) GPU "0" runs it."""
    import torch

    from spark_estimators.torch.model import TorchPredictor
    from spark_estimators.torch.serialization import model_to_bytes

    saved = {
        k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SPARK_ESTIMATORS_GPU_ADDRESSES")
    }
    os.environ["CUDA_VISIBLE_DEVICES"] = "0" if gpu else ""
    os.environ["SPARK_ESTIMATORS_GPU_ADDRESSES"] = "0" if gpu else ""
    try:
        predictor = TorchPredictor()
        model = predictor.load(model_to_bytes(blob_module))
        device = str(next(model.parameters()).device)
        out = predictor.predict(model, [x])[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert (device.startswith("cuda")) == (gpu and torch.cuda.is_available()), device
    return out


def check_torch(root: str, cuda: bool, results: dict) -> None:
    import torch

    from spark_estimators import LocalBackend
    from spark_estimators.store import LocalStore

    store = LocalStore(os.path.join(root, "torch-store"))
    x = write_parquet(store)
    single = "nccl" if cuda else "gloo"

    # 1. one NCCL rank, SyncBatchNorm, bf16 autocast
    rec = tempfile.mkdtemp(dir=root, prefix="rec-")
    torch.manual_seed(0)
    module = make_module(sync=True)
    t0 = time.perf_counter()
    est = torch_estimator(
        store, LocalBackend(1, collective_backend=single), module,
        minibatch_fn(rec, "bfloat16", scaler=False), 2, "torch_hot",
    )  # fmt: skip
    first = est.fit_on_parquet()
    seen = ranks_seen(rec)
    hist = first.getHistory()
    results["torch_bf16_nccl"] = {
        "seconds": round(time.perf_counter() - t0, 1),
        "history": hist,
        "ranks": seen,
    }
    assert [h["epoch"] for h in hist] == [0, 1]
    assert hist[-1]["loss"] < hist[0]["loss"], hist
    assert seen[0]["device"] == ("cuda:0" if cuda else "cpu"), seen
    if cuda:
        assert seen[0]["output_dtype"] == "torch.bfloat16", seen

    # 2. hot start: same run_id, 4 epochs; only epochs 2 and 3 run
    rec2 = tempfile.mkdtemp(dir=root, prefix="rec-")
    torch.manual_seed(5)
    second = torch_estimator(
        store, LocalBackend(1, collective_backend=single), make_module(sync=True),
        minibatch_fn(rec2, "bfloat16", scaler=False), 4, "torch_hot",
    ).fit_on_parquet()  # fmt: skip
    hist2 = second.getHistory()
    calls_first, calls_second = seen[0]["calls"], ranks_seen(rec2)[0]["calls"]
    results["torch_hot_start"] = {
        "epochs": [h["epoch"] for h in hist2],
        "kept_history": hist2[:2] == hist,
        "steps_first_fit": calls_first,
        "steps_hot_start": calls_second,
        "loss": [h["loss"] for h in hist2],
        "checkpoint": sorted(os.listdir(store.get_checkpoint_path("torch_hot"))),
    }
    assert [h["epoch"] for h in hist2] == [0, 1, 2, 3]
    assert hist2[:2] == hist
    assert calls_second == calls_first  # two epochs each
    assert hist2[3]["loss"] < hist2[0]["loss"]

    # 3. fp16 with GradScaler
    rec3 = tempfile.mkdtemp(dir=root, prefix="rec-")
    torch.manual_seed(0)
    fp16 = torch_estimator(
        store, LocalBackend(1, collective_backend=single), make_module(sync=True),
        minibatch_fn(rec3, "float16", scaler=True), 3, "torch_fp16",
    ).fit_on_parquet()  # fmt: skip
    seen3 = ranks_seen(rec3)
    h3 = fp16.getHistory()
    results["torch_fp16_scaler"] = {"loss": [h["loss"] for h in h3], "ranks": seen3}
    assert h3[-1]["loss"] < h3[0]["loss"] and np.isfinite(h3[-1]["loss"]), h3
    if cuda:
        assert seen3[0]["output_dtype"] == "torch.float16", seen3

    # 4. two Gloo ranks sharing cuda:0, SyncBatchNorm across them
    rec4 = tempfile.mkdtemp(dir=root, prefix="rec-")
    torch.manual_seed(0)
    shared_backend = LocalBackend(2, collective_backend="gloo", gpus=["0"] if cuda else None)
    shared = torch_estimator(
        store, shared_backend, make_module(sync=True),
        minibatch_fn(rec4, "bfloat16", scaler=False), 2, "torch_gloo2",
    ).fit_on_parquet()  # fmt: skip
    seen4 = ranks_seen(rec4)
    h4 = shared.getHistory()
    results["torch_gloo_shared"] = {"loss": [h["loss"] for h in h4], "ranks": seen4}
    assert len(seen4) == 2
    assert {s["device"] for s in seen4} == {"cuda:0" if cuda else "cpu"}, seen4
    assert h4[-1]["loss"] < h4[0]["loss"]

    # 5. prediction on the GPU equals the CPU's
    module = first.getModel()
    cpu = predict_on(module, x[:512], gpu=False)
    gpu = predict_on(module, x[:512], gpu=cuda)
    diff = float(np.max(np.abs(cpu - gpu)))
    results["predict"] = {"max_abs_diff": diff, "rows": 512}
    assert diff < 1e-4, diff


def check_lightning(root: str, cuda: bool, results: dict) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F  # noqa: N812

    from spark_estimators import LocalBackend
    from spark_estimators.lightning import LightningEstimator
    from spark_estimators.store import LocalStore

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_module(sync=False)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            out = self(batch["features"]).squeeze(1)
            loss = F.mse_loss(out.float(), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            out = self(batch["features"]).squeeze(1)
            self.log("val_loss", F.mse_loss(out.float(), batch["y"]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Recorder(pl.Callback):
        """Writes what the rank trained with: its BatchNorm's class, device and precision."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_start(self, trainer, pl_module):
            with open(self.path, "w") as f:
                json.dump(
                    {
                        "norm": type(pl_module.net[1]).__name__,
                        "device": str(pl_module.device),
                        "precision": str(trainer.precision),
                    },
                    f,
                )

    store = LocalStore(os.path.join(root, "lightning-store"))
    x = write_parquet(store)
    seen_path = os.path.join(root, "lightning-rank0.json")
    single = "nccl" if cuda else "gloo"

    def estimator(epochs: int) -> LightningEstimator:
        return LightningEstimator(
            store=store,
            backend=LocalBackend(1, collective_backend=single),
            model=Module(),
            feature_cols=["features"],
            label_cols=["y"],
            batch_size=64,
            epochs=epochs,
            random_seed=1,
            verbose=0,
            run_id="light_hot",
            callbacks=[Recorder(seen_path)],
            # Lightning's SyncBatchNorm (torch's) needs CUDA modules.
            trainer_args={"precision": "bf16-mixed", "sync_batchnorm": True} if cuda else {},
        )

    t0 = time.perf_counter()
    torch.manual_seed(0)
    first = estimator(2).fit_on_parquet()
    hist = first.getHistory()
    torch.manual_seed(7)
    second = estimator(3).fit_on_parquet()
    hist2 = second.getHistory()
    module = second.getModel()
    with torch.no_grad():
        cpu = module.cpu().eval()(torch.from_numpy(x[:512])).numpy()
    gpu = cpu
    if cuda:
        with torch.no_grad():
            gpu = module.to("cuda").eval()(torch.from_numpy(x[:512]).to("cuda")).cpu().numpy()
    diff = float(np.max(np.abs(cpu - gpu)))
    with open(seen_path) as f:
        seen = json.load(f)
    results["lightning_bf16"] = {
        "seconds": round(time.perf_counter() - t0, 1),
        "epochs": [h["epoch"] for h in hist2],
        "kept_history": hist2[:2] == hist,
        "loss": [h.get("train_loss") for h in hist2],
        "rank0": seen,
        "predict_max_abs_diff": diff,
    }
    assert [h["epoch"] for h in hist2] == [0, 1, 2]
    assert hist2[:2] == hist
    assert diff < 1e-4, diff
    if cuda:
        assert seen == {"norm": "SyncBatchNorm", "device": "cuda:0", "precision": "bf16-mixed"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=None, help="write results.json here too")
    p.add_argument("--only", choices=["torch", "lightning"], default=None)
    args = p.parse_args()
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("SKIP: --device cuda but torch sees no CUDA device")
        return 0
    results: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }
    failed = []
    with tempfile.TemporaryDirectory(prefix="se-gpu-est-") as root:
        for name, check in (("torch", check_torch), ("lightning", check_lightning)):
            if args.only not in (None, name):
                continue
            try:
                check(root, cuda, results)
            except Exception as exc:  # report every check, then fail
                import traceback

                traceback.print_exc()
                failed.append(name)
                results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    results["failed"] = failed
    line = json.dumps(results, default=str)
    print("RESULT " + line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "estimators.json"), "w") as f:
            f.write(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
