"""data="stream" + Lightning: every rank takes the same steps, whenever the row counts arrive.

The CI hang of ``test_lightning_streams`` (both ranks stuck in DDP's backward allreduce until
gloo's timeout): a streaming reader reported its steps per epoch as soon as the tasks' row
counts had arrived, so a rank that built its dataloader after that moment had a sized loader and
a rank that built it before had an unsized one. Lightning's ``has_len_all_ranks`` runs a
collective (``strategy.reduce``) only for a sized loader: the sized rank's reduce met the other
rank's first gradient allreduce. Which rank saw the counts first depended on timing (a loaded
machine), so this test forces it: two real ranks (``run_local``, gloo) run the real
``lightning.remote.train`` on real spills whose partitions are skewed (150 rows vs 12); rank 0's
counts arrive before it starts, rank 1's only from a ``setup`` hook, after its loaders are built.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from spark_estimators.launch import run_local  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROWS = {0: 150, 1: 12}  # rows of each rank's partition (deliberately skewed)
BATCH = 8
EPOCHS = 2


def is_val(i: int) -> bool:
    return i % 5 == 0


def split_rows() -> dict[int, dict[str, int]]:
    out = {}
    for rank, n in ROWS.items():
        val = sum(is_val(i) for i in range(n))
        out[rank] = {"train": n - val, "val": val}
    return out


class StepCounter(pl.LightningModule):
    """A linear model that counts its train and validation steps per epoch, into a file."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.layer = __import__("torch").nn.Linear(2, 1)
        self.out_dir = out_dir
        self.train_steps: list[int] = []
        self.val_steps: list[int] = []

    def forward(self, x):
        return self.layer(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        import torch

        self.train_steps[-1] += 1
        return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        import torch

        self.val_steps[-1] += 1
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch["x"]), batch["y"]))

    def on_train_epoch_start(self):
        self.train_steps.append(0)

    def on_validation_epoch_start(self):
        self.val_steps.append(0)

    def on_fit_end(self):
        path = os.path.join(self.out_dir, f"steps-{self.global_rank}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"train": self.train_steps, "val": self.val_steps}, f)

    def configure_optimizers(self):
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.05)


class LateTotals(pl.Callback):
    """On ``late_rank``: announce every task's row counts in ``setup``, after the loaders exist."""

    def __init__(self, fd: int, late_rank: int, totals: list[dict[str, int]]) -> None:
        self.fd, self.late_rank, self.totals = fd, late_rank, totals

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == self.late_rank:
            os.write(self.fd, f"T {json.dumps(self.totals)}\n".encode())


def streaming_rank(tmp: str, late_rank: int) -> dict[str, list[int]]:
    """One rank: spill its skewed partition, then ``lightning.remote.train`` on the stream."""
    import cloudpickle

    from spark_estimators import Store
    from spark_estimators.core import rank as protocol
    from spark_estimators.data.metadata import ColumnInfo
    from spark_estimators.data.stream import StreamMetadata
    from spark_estimators.data.stream_reader import _STREAM_FD_ENV
    from spark_estimators.lightning import remote
    from spark_estimators.task.stream_spill import SpillWriter, StreamTaskSettings

    rank, _ = protocol.rank_and_size()
    read_fd, write_fd = os.pipe()
    os.environ[_STREAM_FD_ENV] = str(read_fd)
    spill_dir = os.path.join(tmp, f"spill-{rank}")
    os.makedirs(spill_dir)
    notify = os.fdopen(write_fd, "w", encoding="utf-8")
    writer = SpillWriter(spill_dir, notify, StreamTaskSettings(split_col="is_val"))
    ids = np.arange(ROWS[rank])
    x = np.stack([ids / 100.0, -ids / 200.0], axis=1).astype(np.float32)
    writer.write(
        pa.record_batch(
            {
                "x": pa.array(list(x), pa.list_(pa.float32())),
                "y": pa.array(x[:, 0] - 2 * x[:, 1], pa.float32()),
                "is_val": pa.array([is_val(int(i)) for i in ids]),
            }
        )
    )
    writer.finish()
    totals = [split_rows()[r] for r in sorted(ROWS)]
    if rank != late_rank:
        writer.totals(totals)  # known before this rank builds its dataloaders
    columns = {
        "x": ColumnInfo("x", "array", "float32", (2,)),
        "y": ColumnInfo("y", "scalar", "float32", ()),
    }
    meta = StreamMetadata(columns, ["x"], ["y"], None, has_val=True)
    user = remote.LightningUserObjects(StepCounter(tmp), [LateTotals(write_fd, late_rank, totals)])
    spec = remote.LightningTrainSpec(
        user_blob=cloudpickle.dumps(user),
        store=Store.create(os.path.join(tmp, "store")),
        meta=meta,  # type: ignore[arg-type]
        run_id=f"steps-{os.path.basename(tmp)}",
        feature_cols=["x"],
        label_cols=["y"],
        sample_weight_col=None,
        input_shapes=None,
        label_shapes=None,
        batch_size=BATCH,
        val_batch_size=BATCH,
        epochs=EPOCHS,
        start_epoch=0,
        train_steps_per_epoch=None,
        validation_steps_per_epoch=None,
        shuffle=True,
        seed=1,
        inmemory_cache_all=False,
        use_gpu=False,
        reader="arrow",
        train_reader_num_workers=1,
        val_reader_num_workers=1,
        num_gpus=0,
        collective_backend="gloo",
        backward_passes_per_step=1,
        log_every_n_steps=1,
        trainer_args={},
        terminate_on_nan=False,
        verbose=0,
    )
    try:
        remote.train(spec)
    finally:
        writer.close()
    with open(os.path.join(tmp, f"steps-{rank}.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("late_rank", [1, 0])
def test_skewed_stream_same_steps_on_every_rank(tmp_path, late_rank):
    counts = run_local(
        streaming_rank,
        num_proc=2,
        args=(str(tmp_path), late_rank),
        backend="gloo",
        env={"SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": "45"},
    )
    rows = split_rows()
    train_steps = math.ceil(max(r["train"] for r in rows.values()) / BATCH)
    val_steps = math.ceil(max(r["val"] for r in rows.values()) / BATCH)
    # The agreed count on both ranks: the short rank wraps around its 12 rows.
    assert counts[0] == counts[1] == {"train": [train_steps] * EPOCHS, "val": [val_steps] * EPOCHS}
    assert (train_steps, val_steps) == (15, 4)
