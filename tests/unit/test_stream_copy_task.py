"""``data="parquet+stream"``, one task: the copy gets every row, also after its rank has ended.

``run_streaming_rank`` with a real spill, a real Parquet writer into a LocalStore directory and a
rank that ends (successfully, as a step limit ends it) before the task has read its partition:
the task goes on reading for the copy alone. A rank that fails leaves no file. The barrier
context is a stand-in with the two calls the task makes (one task: allGather returns its own
message), since a real one needs a Spark barrier stage (the integration tests run that).
"""

from __future__ import annotations

import glob
import json
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq

from spark_estimators.data._writer import PartitionWriter
from spark_estimators.data.metadata import ColumnInfo
from spark_estimators.store import LocalStore
from spark_estimators.task.stream_spill import StreamTaskSettings, run_streaming_rank


class OneTask:
    """The BarrierTaskContext calls run_streaming_rank makes, for a stage of one task."""

    def __init__(self):
        self.gathered = []

    def partitionId(self):  # noqa: N802 - pyspark's name
        return 0

    def attemptNumber(self):  # noqa: N802
        return 0

    def allGather(self, message):  # noqa: N802
        self.gathered.append(json.loads(message))
        return [message]


def settings(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    plan = PartitionWriter(
        spec=store.filesystem_spec,
        train_dir=store.get_train_data_path("idx"),
        val_dir=None,
        token="tok",
        columns=(ColumnInfo("x", "scalar", "float64", ()),),
        split_col=None,
        drop_invalid=False,
        row_group_bytes=1 << 20,
        max_file_bytes=1 << 30,
    )
    return StreamTaskSettings(copy=plan)


def join_rank_thread():
    """Wait until the task's rank thread has ended (its ``done`` event is set by then)."""
    for thread in threading.enumerate():
        if thread.name == "se-stream-rank":
            thread.join(30)
            assert not thread.is_alive()


def batches_after(rank_ended, n_batches=5, rows=100):
    """The first batch at once, the others only once the rank (and its thread) has ended."""
    for b in range(n_batches):
        if b == 1:
            assert rank_ended.wait(30)
            join_rank_thread()
        yield pa.RecordBatch.from_pydict({"x": [float(b * rows + i) for i in range(rows)]})


def parquet_files(tmp_path):
    return sorted(glob.glob(os.path.join(str(tmp_path), "**", "*.parquet"), recursive=True))


def test_the_copy_gets_the_rows_its_rank_never_read(tmp_path):
    ended = threading.Event()

    def rank_done_early(fifo, outcome):
        outcome["code"] = 0
        ended.set()
        return 0

    ctx = OneTask()
    rank, report = run_streaming_rank(
        settings(tmp_path), batches_after(ended), ctx, rank_done_early
    )
    assert rank == 0
    lines = [json.loads(line) for line in json.loads(report)["lines"]]
    files = [d for d in lines if "path" in d]
    assert sum(f["rows"] for f in files) == 500
    assert lines[-1]["stats"]["rows_in"] == 500
    table = pq.read_table([f["path"] for f in files])
    assert sorted(table.column("x").to_pylist()) == [float(i) for i in range(500)]
    # The totals went out once, when the rank ended (it had been sent at most the first batch).
    assert len(ctx.gathered) == 1
    assert ctx.gathered[0]["train"] <= 100


def test_a_failed_rank_leaves_no_copy(tmp_path):
    ended = threading.Event()

    def rank_fails(fifo, outcome):
        outcome["code"] = 1
        ended.set()
        return 0

    ctx = OneTask()
    _, report = run_streaming_rank(settings(tmp_path), batches_after(ended), ctx, rank_fails)
    assert json.loads(report) == {"lines": []}
    assert parquet_files(tmp_path) == []
    assert ctx.gathered == []  # the job is aborting: no totals


def test_a_rank_that_outlives_the_partition_gets_a_complete_copy(tmp_path):
    finish = threading.Event()

    def rank_trains_on(fifo, outcome):
        assert finish.wait(30)
        outcome["code"] = 0
        return 0

    def batches():
        for b in range(3):
            yield pa.RecordBatch.from_pydict({"x": [float(b)] * 10})
        finish.set()  # the partition is read; the copy is closed while the rank still runs

    _, report = run_streaming_rank(settings(tmp_path), batches(), OneTask(), rank_trains_on)
    lines = [json.loads(line) for line in json.loads(report)["lines"]]
    assert sum(d["rows"] for d in lines if "path" in d) == 30
