"""The data="stream" spill and reader without Spark: a task's SpillWriter, a rank's reader.

Real pipes and files: the writer announces segments on a pipe as a Spark task does, the rank's
StreamSource follows it on its thread, and StreamBatchReader cuts equal-sized batches.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.data.stream_reader import StreamBatchReader, StreamSource
from spark_estimators.errors import ConfigurationError
from spark_estimators.task.stream_spill import SpillWriter, StreamTaskSettings

COLUMNS = {
    "id": ColumnInfo("id", "scalar", "int64", ()),
    "arr": ColumnInfo("arr", "array", "float32", (2,)),
}


class Spill:
    """One task's spill and its rank's source, in this process."""

    def __init__(self, directory, split_col=None, segment_bytes=400):
        os.makedirs(directory, exist_ok=True)
        read_fd, write_fd = os.pipe()
        self.source = StreamSource(read_fd)
        settings = StreamTaskSettings(split_col=split_col, segment_bytes=segment_bytes)
        self.writer = SpillWriter(str(directory), os.fdopen(write_fd, "w"), settings)

    def write(self, ids, batch_rows=10, flag=None):
        for start in range(0, len(ids), batch_rows):
            part = np.asarray(ids[start : start + batch_rows], dtype=np.int64)
            cols = {
                "id": pa.array(part),
                "arr": pa.array([[float(i), float(-i)] for i in part], pa.list_(pa.float32())),
            }
            if flag is not None:
                cols["is_val"] = pa.array([bool(flag(i)) for i in part])
            self.writer.write(pa.record_batch(cols))

    def reader(self, split="train", **kw):
        opts = dict(split=split, batch_size=8, shuffle=True, seed=3, prefetch=1)
        opts.update(kw)
        return StreamBatchReader(self.source, COLUMNS, **opts)


def ids(batches):
    return [int(i) for b in batches for i in b["id"]]


def finish_all(spills):
    for s in spills:
        s.writer.finish()
    totals = [dict(s.writer.rows) for s in spills]
    for s in spills:
        s.writer.totals(totals)
    for s in spills:
        s.writer.close()


@pytest.mark.parametrize("shuffle", [True, False])
def test_equal_steps_every_row_and_exact_extra_reads(tmp_path, shuffle):
    rows = {0: range(0, 50), 1: range(100, 137)}
    spills = [Spill(tmp_path / str(r)) for r in rows]
    for spill, r in zip(spills, rows, strict=True):
        spill.write(list(rows[r]))
    finish_all(spills)
    readers = [s.reader(rank=r, shuffle=shuffle) for r, s in enumerate(spills)]
    for epoch in range(2):
        epochs = [list(reader) for reader in readers]
        # ceil(max(50, 37) / 8) = 7 batches on both ranks, every batch full
        assert [len(e) for e in epochs] == [7, 7]
        assert all(len(b["id"]) == 8 for e in epochs for b in e)
        extra = 0
        for r, e in enumerate(epochs):
            reads = Counter(ids(e))
            assert set(reads) == set(rows[r])  # each rank reads all its rows, only its rows
            extra += sum(reads.values()) - len(rows[r])
        # Exactly the wrap-around fill: 7 steps x 8 rows x 2 ranks - 87 rows (the Parquet rule
        # with the shards Spark's partitions give, here deliberately unequal).
        assert extra == 7 * 8 * 2 - 87
        np.testing.assert_array_equal(epochs[0][0]["arr"][:, 1], -epochs[0][0]["id"])
    assert readers[0].agreed_steps == 7 and readers[0].epoch == 2


def test_first_epoch_trains_before_the_count_is_known(tmp_path):
    """Batches flow while the partition is still being read; the count comes at the end."""
    spill = Spill(tmp_path / "0", segment_bytes=1)  # every task batch is a segment
    reader = spill.reader(shuffle=False)
    spill.write(list(range(20)))  # 2 full batches and 4 rows so far
    assert reader.agreed_steps is None
    epoch = iter(reader)
    first_two = [next(epoch), next(epoch)]
    assert ids(first_two) == list(range(16))
    spill.write(list(range(20, 26)))
    spill.writer.finish()
    # The other rank had 40 rows: 5 steps, so this rank wraps around its 26 rows.
    spill.writer.totals([{"train": 26, "val": 0}, {"train": 40, "val": 0}])
    rest = list(epoch)
    assert len(rest) == 3 and reader.agreed_steps == 5
    assert ids(rest)[:10] == list(range(16, 26))
    assert set(ids(rest)[10:]) <= set(range(26))
    assert len(list(reader)) == 5  # later epochs know the count


def test_the_count_is_never_a_length_whether_or_not_the_totals_are_in(tmp_path):
    """No rank may look sized when another does not: frameworks shape their loop by len().

    (Lightning's has_len_all_ranks reduces the lengths of sized loaders only; a rank whose
    totals had arrived ran that reduce alone and met the other rank's gradient allreduce.)
    """
    spills = [Spill(tmp_path / "0"), Spill(tmp_path / "1")]
    spills[0].write(list(range(50)))
    spills[1].write(list(range(100, 112)))
    before = spills[1].reader(rank=1)
    finish_all(spills)
    after = spills[0].reader(rank=0)
    assert after.source.totals()  # the totals are in for both readers now
    for reader in (before, after):
        assert reader.steps_per_epoch is None
        with pytest.raises(TypeError, match="no len"):
            len(reader)
    # Each still ends every epoch at the agreed count: ceil(50 / 8) = 7 on both ranks.
    assert [len(list(r)) for r in (before, after, before)] == [7, 7, 7]
    assert before.agreed_steps == after.agreed_steps == 7


def test_step_limit_and_multiple_before_the_count_is_known(tmp_path):
    spill = Spill(tmp_path / "0")
    spill.write(list(range(200)))
    reader = spill.reader(shuffle=False)
    reader.plan(limit=3, multiple=2)  # epoch_steps' rule: min(T, 3) rounded up to 4
    assert len(list(reader)) == 4
    spill.writer.finish()
    spill.writer.totals([{"train": 200, "val": 0}])
    reader.plan(limit=None, multiple=1)
    assert len(list(reader)) == 25


def test_validation_rows_go_to_the_val_split(tmp_path):
    spill = Spill(tmp_path / "0", split_col="is_val")
    spill.write(list(range(60)), flag=lambda i: i % 4 == 0)
    finish_all([spill])
    val = list(spill.reader("val", shuffle=False, batch_size=5))
    train = list(spill.reader("train"))
    assert ids(val) == list(range(0, 60, 4))
    assert set(ids(train)) == {i for i in range(60) if i % 4}
    assert "is_val" not in train[0]


def test_a_rank_without_rows_is_a_clear_error(tmp_path):
    spills = [Spill(tmp_path / "0"), Spill(tmp_path / "1")]
    spills[0].write(list(range(30)))
    finish_all(spills)
    with pytest.raises(ConfigurationError, match="1 of 2 ranks got no train rows"):
        list(spills[1].reader(rank=1))


@pytest.mark.parametrize("shuffle", [True, False])
def test_memory_is_bounded_by_the_buffer_not_the_data(tmp_path, monkeypatch, shuffle):
    import spark_estimators.data.reader as reader_module

    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 200)  # 16-byte rows: blocks of 16
    spill = Spill(tmp_path / "0", segment_bytes=2000)
    spill.write(list(range(6000)), batch_rows=10)
    finish_all([spill])
    assert len(os.listdir(tmp_path / "0")) > 10  # many segments on disk, not in memory
    reader = spill.reader(shuffle=shuffle, shuffle_buffer_size=300, batch_size=16)
    assert len(set(ids(reader))) == 6000
    buffer = 300 if shuffle else 0
    block = 16  # the shuffle buffer's blocks; unshuffled blocks are the task's 10-row batches
    bound = buffer + (reader.prefetch + 2) * (block + reader.batch_size)
    assert buffer < reader.held_rows_peak <= bound


def test_a_task_that_stops_streaming_fails_the_reader(tmp_path):
    from spark_estimators.errors import StoreError

    spill = Spill(tmp_path / "0")
    spill.write(list(range(5)))
    spill.writer.close()  # the task died: the pipe closes without the end of the partition
    with pytest.raises(StoreError, match="stopped streaming"):
        list(spill.reader())


@pytest.mark.parametrize(
    ("arr", "ids", "message"),
    [
        ([[1.0, 2.0], [float("nan"), 0.0]], [0, 1], r"'arr' has null or NaN .* \[nan, 0\.0\]"),
        ([[1.0, 2.0], None], [0, 1], r"column 'arr' has null or NaN values in 1 row\(s\).* None"),
        ([[1.0, 2.0], [1.0]], [0, 1], r"column 'arr' has wrong-length .*needs 2 values"),
        ([[1.0, 2.0], [3.0, 4.0]], [0, None], r"column 'id' has null .*subset=\['id'\]"),
    ],
)
def test_bad_rows_fail_the_reader_naming_the_column_and_value(tmp_path, arr, ids, message):
    spill = Spill(tmp_path / "0")
    spill.writer.write(
        pa.record_batch(
            {"id": pa.array(ids, pa.int64()), "arr": pa.array(arr, pa.list_(pa.float32()))}
        )
    )
    finish_all([spill])
    with pytest.raises(ConfigurationError, match=message) as caught:
        list(spill.reader())
    assert "rank 0 (train rows)" in str(caught.value)
    assert "drop_invalid_rows=True" in str(caught.value)
