"""Wide rows (issue 43): batches joined from blocks smaller than a batch, staged batch buffers.

The sizes are scaled down (``BLOCK_BYTES`` and ``LARGE_BATCH_BYTES`` patched) so that a block of
4 rows is smaller than a batch, as a 1 MB block of 3x64x64 images is smaller than a batch of 256.
Pinned memory itself needs CUDA (tests/gpu/test_reader_pinned.py); here the same code path runs
with a plain CPU allocator that records what it hands out.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import DatasetMetadata, make_batch_reader, torch_batches
from spark_estimators.data.reader import steps_per_epoch
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore

WIDTH = 48  # values per row: an image of 3 x 4 x 4


def write_images(store, rows: int, files: int = 3, row_group: int = 9) -> DatasetMetadata:
    """``rows`` rows: id, img = id * 1000 + [0, 1, ..., 47] (float32), y = -id."""
    path = store.get_train_data_path()
    store.makedirs(path)
    ids = np.arange(rows)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for k in range(files):
        part = ids[bounds[k] : bounds[k + 1]]
        img = (part[:, None] * 1000 + np.arange(WIDTH)).astype(np.float32)
        table = pa.table(
            {
                "id": pa.array(part, pa.int64()),
                "img": pa.FixedSizeListArray.from_arrays(pa.array(img.ravel()), WIDTH).cast(
                    pa.list_(pa.float32())
                ),
                "y": pa.array(-part, pa.float32()),
            }
        )
        pq.write_table(table, f"{path}/part-{k:03d}.parquet", row_group_size=row_group)
    return DatasetMetadata.from_parquet(store, path, feature_cols=["id", "img"], label_cols=["y"])


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


@pytest.fixture
def wide(monkeypatch):
    """Rows of 8 + 192 + 4 = 204 bytes: blocks of 4 rows, batches of 10 rows joined from them."""
    import spark_estimators.data.reader as reader_module

    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(reader_module, "LARGE_BATCH_BYTES", 1000)


def epoch_ids(reader) -> list[list[int]]:
    return [b["id"].tolist() for b in reader]


def check_values(batch) -> None:
    ids = np.asarray(batch["id"]).astype(np.int64)
    img = np.asarray(batch["img"]).reshape(len(ids), WIDTH)
    np.testing.assert_array_equal(img, (ids[:, None] * 1000 + np.arange(WIDTH)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(batch["y"]), -ids.astype(np.float32))


@pytest.mark.parametrize(("rows", "size"), [(100, 1), (101, 2), (60, 3)])
def test_wide_rows_read_in_order_per_shard_with_their_values(store, wide, rows, size):
    meta = write_images(store, rows)
    shards = []
    for rank in range(size):
        reader = make_batch_reader(store, meta, rank=rank, size=size, batch_size=10, shuffle=False)
        assert reader.block_rows == 4  # smaller than a batch: batches are joined from blocks
        batches = list(reader)
        assert len(batches) == steps_per_epoch(rows, size, 10)
        for b in batches:
            assert b["img"].shape == (10, WIDTH) and b["img"].dtype == np.float32
            assert b["img"].flags.writeable and b["img"].flags.c_contiguous
            check_values(b)
        flat = [i for b in batches for i in b["id"].tolist()]
        start, n = flat[0], reader.shard_rows
        # The shard's rows in file order, then its own rows again (wrap-around) to fill the epoch.
        assert flat[:n] == list(range(start, start + n))
        assert flat[n:] == flat[: len(flat) - n]
        shards.append(set(flat))
    assert set().union(*shards) == set(range(rows))


@pytest.mark.parametrize("shuffle", [False, True])
def test_joining_blocks_changes_nothing_that_is_read(store, monkeypatch, shuffle):
    """The same batches, seed for seed, with blocks of 4 rows as with blocks larger than a batch."""
    import spark_estimators.data.reader as reader_module

    meta = write_images(store, 157, files=2, row_group=40)

    def two_epochs():
        reader = make_batch_reader(
            store, meta, rank=0, size=1, batch_size=10, shuffle=shuffle, seed=5,
            shuffle_buffer_size=60,
        )  # fmt: skip
        return reader.block_rows, [epoch_ids(reader), epoch_ids(reader)]

    big_rows, big = two_epochs()
    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(reader_module, "LARGE_BATCH_BYTES", 1000)
    small_rows, small = two_epochs()
    assert big_rows > 10 and small_rows == 4
    assert small == big
    assert big[0] != big[1] if shuffle else big[0] == big[1]


def test_wide_rows_shuffled_read_every_row_with_its_values(store, wide):
    rows, size, batch_size = 131, 2, 10
    meta = write_images(store, rows)
    reads: Counter[int] = Counter()
    for rank in range(size):
        reader = make_batch_reader(
            store, meta, rank=rank, size=size, batch_size=batch_size, shuffle=True, seed=1
        )
        for b in torch_batches(reader, shapes={"img": (3, 4, 4)}, pin_memory=False):
            assert tuple(b["img"].shape) == (batch_size, 3, 4, 4)
            check_values({k: v.numpy() for k, v in b.items()})
            reads.update(b["id"].tolist())
    assert set(reads) == set(range(rows))
    assert 0 <= sum(reads.values()) - rows < size * batch_size


class Recorder:
    """A staging allocator on the CPU: plain tensors, every buffer it handed out remembered."""

    def __init__(self) -> None:
        self.buffers: list = []

    def __call__(self, shape, dtype):
        import torch

        buf = torch.empty(shape, dtype=dtype)
        self.buffers.append(buf)
        return buf

    def rows(self, ndim: int) -> int:
        return sum(b.shape[0] for b in self.buffers if b.dim() == ndim)


def staged_epoch(reader, staging, dtypes=None):
    import torch

    from spark_estimators.data.adapters import converted_epoch
    from spark_estimators.data.reader import BlockFormat

    def to_torch(block):
        out = {k: torch.from_numpy(v) for k, v in block.items()}
        for name, dtype in (dtypes or {}).items():
            out[name] = out[name].to(dtype)
        return out

    fmt = BlockFormat(convert=to_torch, concat=torch.cat, staging=staging)
    return list(converted_epoch(reader, fmt))


@pytest.mark.parametrize("is_wide", [True, False])
def test_staged_batches_live_in_the_staging_buffers_each_row_copied_once(
    store, monkeypatch, is_wide
):
    import spark_estimators.data.reader as reader_module

    if is_wide:
        monkeypatch.setattr(reader_module, "BLOCK_BYTES", 1000)
        monkeypatch.setattr(reader_module, "LARGE_BATCH_BYTES", 1000)
    meta = write_images(store, 97, files=2, row_group=30)
    plain = epoch_ids(make_batch_reader(store, meta, rank=0, size=1, batch_size=10, shuffle=False))
    staging = Recorder()
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, shuffle=False)
    batches = staged_epoch(reader, staging)
    assert [b["id"].tolist() for b in batches] == plain
    starts = {buf.untyped_storage().data_ptr() for buf in staging.buffers}
    for b in batches:
        check_values({k: v.numpy() for k, v in b.items()})
        for t in b.values():
            assert t.untyped_storage().data_ptr() in starts  # a view of a staging buffer
    # Every row of every batch was copied into a staging buffer exactly once (img: 2-d, ids 1-d).
    assert staging.rows(2) == len(batches) * 10
    assert staging.rows(1) == 2 * len(batches) * 10  # id and y


def test_staging_keeps_dtypes_numpy_lacks(store, wide):
    import torch

    meta = write_images(store, 50)
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, shuffle=False)
    batches = staged_epoch(reader, Recorder(), dtypes={"img": torch.bfloat16})
    assert len(batches) == 5
    for b in batches:
        assert b["img"].dtype == torch.bfloat16
        ids = b["id"][:, None] * 1000 + torch.arange(WIDTH)
        assert torch.equal(b["img"], ids.to(torch.float32).to(torch.bfloat16))


def test_pinning_follows_cuda_use(store):
    import torch

    from spark_estimators.data._staging import staging_allocator

    assert staging_allocator(False, None) is None
    mine = Recorder()
    assert staging_allocator(True, mine) is mine  # an explicit allocator wins
    if not torch.cuda.is_available():
        assert staging_allocator(None, None) is None  # no CUDA in use: batches stay unpinned
        with pytest.raises(ConfigurationError, match="pin_memory=True needs a CUDA device"):
            staging_allocator(True, None)
        meta = write_images(store, 20)
        reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, shuffle=False)
        with pytest.raises(ConfigurationError, match="pin_memory=True needs a CUDA device"):
            list(torch_batches(reader, pin_memory=True))
    else:
        assert staging_allocator(True, None) is not None


def test_default_shuffle_buffer_is_bounded_in_bytes(store):
    from spark_estimators.data.metadata import ColumnInfo
    from spark_estimators.data.reader import default_shuffle_rows

    image = {"x": ColumnInfo("x", "array", "float32", (3 * 64 * 64,), "array<float>")}
    narrow = {"x": ColumnInfo("x", "array", "float32", (32,), "array<float>")}
    assert default_shuffle_rows(image, 256) == (256 << 20) // (3 * 64 * 64 * 4)  # 5461 images
    assert default_shuffle_rows(narrow, 256) == 100_000  # unchanged for narrow rows
    assert default_shuffle_rows(image, 4096) == 4 * 4096  # still at least 4 batches


@pytest.mark.slow
def test_gpu_bench_reader_only_runs_tiny():
    """bench/gpu.py --reader-only (issue 43) at CI sizes: every case reads every row."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--reader-only", "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])["reader_only"]
    assert len(out["samples_per_s"]) == 6
    assert all(v[0] > 0 for v in out["samples_per_s"].values())
    assert out["ours_vs_raw"] > 0
