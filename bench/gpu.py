"""TorchEstimator's rank loop vs a plain torch loop on one GPU: a ResNet-18 on 3x64x64 images.

    python bench/gpu.py                      # a CUDA machine: 8192 images, batch 256, 3 rounds
    python bench/gpu.py --tiny               # anywhere (CI): small sizes, on the CPU without CUDA

Both sides train the same ResNet-18 (the torchvision layout: 4 stages of 2 basic blocks,
64-128-256-512 channels, one output) with SGD (momentum 0.9) and MSE on synthetic images, in
float32 (TF32 convolutions, torch's default), batch 256, in the same process tree on the same
GPU, alternating round by round:

* ours: ``TorchEstimator.fit_on_parquet`` with ``LocalBackend(num_proc=1)`` (one rank process,
  NCCL) on the images as Parquet in a LocalStore (one list<float> column of 12288 values per row,
  written here with pyarrow; no Spark). The rank's reader, converter, DistributedOptimizer and
  loop run as in any fit. Measured: the train passes of epochs 2.. (epoch 1 warms cuDNN up),
  from ``on_epoch_begin`` to ``on_epoch_end`` with the GPU synchronised at both ends, by a
  callback in the rank.
* plain: the same model and optimizer in a plain loop over the same rows, held in pinned host
  memory, copied batch by batch with ``non_blocking=True`` (what a tuned DataLoader gives).

Prints samples/s of each, the ratio ours/plain (target >= 0.95) and ``RESULT <json>``. Without
CUDA the script runs the same comparison on the CPU at the sizes given (``--tiny`` in CI) and
says that the GPU figure was skipped. A GPU run first measures the reader alone (below, one
round), so one command gives both figures on the same host.

``--reader-only`` (no GPU needed; issue 43): the rank's input side alone on the same files, in
rounds that alternate the cases, samples/s into ready torch batches and CPU time per row (all
threads):

* raw ``pq.read_table`` per file + flatten + numpy reshape (what the H200 session measured), and
  raw ``ParquetFile.iter_batches`` of ``--batch`` rows + flatten + reshape (the fastest
  streaming decode with pyarrow's defaults);
* ours: ``make_batch_reader`` + the rank's ``BatchConverter`` (``input_shapes`` [-1, 3, 64, 64],
  what ``TorchEstimator`` feeds its model) through ``epoch_batches``, with 1, 2 (the default) and
  4 decode threads, and shuffled;

and ours against the plain GPU loop's consumption rate recorded in bench/RESULTS.md (an H200:
17959 and 20642 samples/s), i.e. whether the reader can feed that GPU from this host's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def resnet18(width: int = 64, outputs: int = 1):
    """ResNet-18 (torchvision's layout, BasicBlock x [2, 2, 2, 2]) without torchvision."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + (x if self.down is None else self.down(x)))

    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, outputs)]
    return nn.Sequential(*layers)


def write_images(store, rows: int, size: int, files: int = 4) -> np.ndarray:
    """Synthetic images (features) and a target (y) as Parquet at the store's train path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 3 * size * size), dtype=np.float32)
    y = x[:, :: max(1, x.shape[1] // 64)].mean(axis=1).astype(np.float32)
    path = store.get_train_data_path()
    os.makedirs(path, exist_ok=True)
    per = -(-rows // files)
    for i in range(files):
        part = slice(i * per, min(rows, (i + 1) * per))
        flat = pa.array(x[part].ravel())
        column = pa.FixedSizeListArray.from_arrays(flat, x.shape[1]).cast(pa.list_(pa.float32()))
        pq.write_table(
            pa.table({"features": column, "y": pa.array(y[part])}),
            os.path.join(path, f"part-{i}.parquet"),
            compression="none",
        )
    return np.concatenate([x, y[:, None]], axis=1)


class EpochClock:
    """Rank callback: wall time of each train pass, GPU synchronised, written to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = 0.0
        self.seconds: list[float] = []

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def on_epoch_begin(self, epoch: int, logs: dict) -> None:
        self._sync()
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        # on_epoch_end runs after the epoch's loss allreduce, which waits for the GPU anyway.
        self._sync()
        self.seconds.append(time.perf_counter() - self.started)
        with open(self.path, "w") as f:
            json.dump(self.seconds, f)


def ours(store, args, device: str, work: str, round_no: int) -> float:
    """Samples/s of TorchEstimator's rank loop (epochs after the first)."""
    import torch

    from spark_estimators import LocalBackend
    from spark_estimators.torch import TorchEstimator

    torch.manual_seed(0)
    model = resnet18(args.width)
    clock = os.path.join(work, f"clock-{round_no}.json")
    est = TorchEstimator(
        store=store,
        backend=LocalBackend(
            1,
            collective_backend="nccl" if device == "cuda" else "gloo",
            use_gpu=device == "cuda",
        ),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        input_shapes=[[-1, 3, args.image, args.image]],
        batch_size=args.batch,
        epochs=args.epochs,
        random_seed=1,
        verbose=0,
        scale_lr=False,
        shuffle=False,
        callbacks=[EpochClock(clock)],
        run_id=f"bench_{round_no}",
        **({"train_reader_num_workers": args.reader_workers} if args.reader_workers else {}),
    )
    est.fit_on_parquet()
    with open(clock) as f:
        seconds = json.load(f)[1:]
    return args.rows * len(seconds) / sum(seconds)


def plain(data: np.ndarray, args, device: str) -> float:
    """Samples/s of a plain torch loop over the same rows (pinned memory, async copies)."""
    import torch

    torch.manual_seed(0)
    dev = torch.device(device)
    model = resnet18(args.width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    x = torch.from_numpy(data[:, :-1]).reshape(-1, 3, args.image, args.image)
    y = torch.from_numpy(data[:, -1:]).clone()
    if dev.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    seconds = []
    for _ in range(args.epochs):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for start in range(0, args.rows, args.batch):
            xb = x[start : start + args.batch].to(dev, non_blocking=True)
            yb = y[start : start + args.batch].to(dev, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.detach()
        float(total)  # the epoch's loss, as ours reports one (waits for the GPU)
        seconds.append(time.perf_counter() - t0)
    return args.rows * (len(seconds) - 1) / sum(seconds[1:])


# The plain loop's samples/s on one H200 (bench/RESULTS.md, 2026-11-27 23:44 and 11-28 00:35 UTC).
PLAIN_H200 = (17959.0, 20642.0)


def reader_rounds(store, args) -> dict:
    """Reader-only rounds (module docstring): samples/s and CPU us/row per case, medians."""
    import pyarrow.parquet as pq

    from spark_estimators.core.batches import BatchConverter, epoch_batches
    from spark_estimators.data import DatasetMetadata, make_batch_reader

    meta = DatasetMetadata.from_parquet(store, feature_cols=["features"], label_cols=["y"])
    files = [f.path for f in meta.train_files]
    shape = (-1, 3, args.image, args.image)
    convert = BatchConverter(["features"], ["y"], input_shapes=[list(shape)])

    def raw_table():
        for path in files:
            table = pq.read_table(path, columns=["features", "y"])
            x = table.column("features").combine_chunks().flatten().to_numpy().reshape(shape)
            yield len(x) + 0 * len(table.column("y").to_numpy())

    def raw_batches():
        for path in files:
            source = pq.ParquetFile(path)
            for rb in source.iter_batches(batch_size=args.batch, columns=["features", "y"]):
                x = rb.column(0).flatten().to_numpy().reshape(shape)
                yield len(x) + 0 * len(rb.column(1).to_numpy())

    def ours(workers: int, shuffle: bool = False):
        def run():
            reader = make_batch_reader(
                store, meta, rank=0, size=1, batch_size=args.batch, shuffle=shuffle,
                num_workers=workers,
            )  # fmt: skip
            for batch in epoch_batches(reader, convert):
                assert batch["features"].shape[1:] == shape[1:]
                yield len(batch["y"])

        return run

    cases = {
        "raw pq.read_table + reshape": raw_table,
        "raw iter_batches + reshape": raw_batches,
        "ours, 1 decode thread": ours(1),
        "ours, 2 decode threads (default)": ours(2),
        "ours, 4 decode threads": ours(4),
        "ours, shuffle": ours(2, shuffle=True),
    }
    sum(raw_table())  # page cache warm
    speed: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            n = sum(fn())
            speed[name].append(n / (time.perf_counter() - t0))
            cpu[name].append((time.process_time() - c0) / n * 1e6)
    med = {k: statistics.median(v) for k, v in speed.items()}
    raw = max(med["raw pq.read_table + reshape"], med["raw iter_batches + reshape"])
    ours2 = med["ours, 2 decode threads (default)"]
    size = f"3x{args.image}x{args.image}"
    print(f"reader only: {args.rows} rows of {size} float32, batch {args.batch}")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians of rounds")
    for name in cases:
        shown = ", ".join(f"{v:.0f}" for v in speed[name])
        print(
            f"  {name:34s} {med[name]:9.0f} samples/s ({shown})  x raw {med[name] / raw:5.2f}  "
            f"CPU {statistics.median(cpu[name]):6.1f} us/row"
        )
    feeds = ours2 / max(PLAIN_H200)
    print(
        f"  ours (default) / best raw = {ours2 / raw:.2f}x; ours / the H200 plain loop's "
        f"{max(PLAIN_H200):.0f} samples/s = {feeds:.2f}x (>= 1: this host's reader feeds it)"
    )
    return {
        "samples_per_s": speed,
        "cpu_us_per_row": cpu,
        "ours_vs_raw": round(ours2 / raw, 3),
        "ours_vs_h200_plain": round(feeds, 3),
        "load": os.getloadavg()[0],
        "cores": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3, help="per side and round; the first warms up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=64, help="channels of the first stage")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--reader-workers", type=int, default=0, help="train_reader_num_workers")
    p.add_argument("--tiny", action="store_true", help="CI sizes: 64 rows of 3x16x16, width 8")
    p.add_argument(
        "--reader-only", action="store_true", help="the reader vs raw pyarrow, no training"
    )
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args()
    if args.tiny:
        args.rows, args.image, args.batch, args.width = 64, 16, 16, 8
        args.epochs, args.rounds = 2, 1
    import torch

    from spark_estimators.store import LocalStore

    if args.reader_only:
        with tempfile.TemporaryDirectory(prefix="se-bench-gpu-") as work:
            store = LocalStore(os.path.join(work, "store"))
            write_images(store, args.rows, args.image)
            line = json.dumps({"reader_only": reader_rounds(store, args)})
        print("RESULT " + line)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_gpu_reader.json"), "w") as f:
                f.write(line)
        return 0
    has_cuda = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        print("SKIP: --device cuda but torch sees no CUDA device")
        return 0
    if device == "cpu":
        print("SKIP (GPU figure): no CUDA device here; the same comparison runs on the CPU")
    result: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": args.rows,
        "image": [3, args.image, args.image],
        "batch": args.batch,
        "epochs_timed": args.epochs - 1,
        "width": args.width,
        "reader_workers": args.reader_workers or "default",
        "ours": [],
        "plain": [],
    }
    with tempfile.TemporaryDirectory(prefix="se-bench-gpu-") as work:
        store = LocalStore(os.path.join(work, "store"))
        t0 = time.perf_counter()
        data = write_images(store, args.rows, args.image)
        result["write_s"] = round(time.perf_counter() - t0, 1)
        if device == "cuda":  # the reader alone on this host's CPU, one round
            rounds, args.rounds = args.rounds, 1
            result["reader_only"] = reader_rounds(store, args)
            args.rounds = rounds
        for r in range(args.rounds):
            result["plain"].append(plain(data, args, device))
            result["ours"].append(ours(store, args, device, work, r))
            print(
                f"round {r + 1}: ours {result['ours'][-1]:.0f} samples/s, "
                f"plain {result['plain'][-1]:.0f} samples/s",
                flush=True,
            )
    o, q = statistics.median(result["ours"]), statistics.median(result["plain"])
    result["ratio"] = round(o / q, 3)
    print(f"median: ours {o:.0f} samples/s, plain {q:.0f} samples/s, ratio {o / q:.3f} (>= 0.95)")
    line = json.dumps(result)
    print("RESULT " + line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            f.write(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
