"""The reader's batches in pinned host memory on a CUDA machine (issue 43; skipped without CUDA).

tests/unit/test_data_reader_wide.py runs the same staging path on the CPU with a plain allocator;
what only CUDA shows is checked here: batches are pinned once the process uses CUDA, and a
``non_blocking`` copy of each to the GPU carries its values.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import DatasetMetadata, make_batch_reader, torch_batches
from spark_estimators.store import LocalStore


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not _has_cuda(), reason="pinned host memory needs a CUDA device; none here"),
]

WIDTH = 3 * 64 * 64


@pytest.mark.parametrize("rows", [300, 1030])  # one batch per block / batches joined from blocks
def test_batches_are_pinned_and_copy_to_the_gpu_asynchronously(tmp_path, rows):
    import torch

    store = LocalStore(str(tmp_path / "store"))
    path = store.get_train_data_path()
    store.makedirs(path)
    ids = np.arange(rows)
    img = (ids[:, None] % 97 + np.arange(WIDTH) % 13).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(img.ravel()), WIDTH)
    table = pa.table({"id": pa.array(ids), "img": column.cast(pa.list_(pa.float32()))})
    pq.write_table(table, f"{path}/part-0.parquet", row_group_size=500)
    meta = DatasetMetadata.from_parquet(store, path, feature_cols=["img"], label_cols=["id"])
    torch.zeros(1, device="cuda")  # the process now uses CUDA: batches are pinned by default
    batch_size = 64 if rows == 300 else 256  # 3 MB (blocks of whole batches) or 12 MB batches
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=batch_size, shuffle=False)
    seen = []
    for batch in torch_batches(reader, shapes={"img": (3, 64, 64)}):
        assert batch["img"].is_pinned() and batch["id"].is_pinned()
        on_gpu = batch["img"].to("cuda", non_blocking=True)
        batch_ids = batch["id"].to("cuda", non_blocking=True)
        want = (batch_ids[:, None] % 97).float() + torch.arange(WIDTH, device="cuda") % 13
        assert torch.equal(on_gpu.reshape(len(batch_ids), WIDTH), want)
        seen += batch["id"].tolist()
    assert seen[:rows] == list(range(rows))
    unpinned = next(iter(torch_batches(reader, pin_memory=False)))
    assert not unpinned["img"].is_pinned()
