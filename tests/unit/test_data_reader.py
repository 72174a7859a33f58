"""The Arrow batch reader: equal steps per rank, coverage, shuffling, cache, pipeline options."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import DatasetMetadata, make_batch_reader, torch_batches
from spark_estimators.data.reader import plan_shard, steps_per_epoch
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore


def write_dataset(store, rows: int, files: int = 3, row_group: int = 7) -> DatasetMetadata:
    """``rows`` rows (id, x = id / 2, arr = [id, -id]) over ``files`` files of small row groups."""
    path = store.get_train_data_path()
    ids = np.arange(rows)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for k in range(files):
        part = ids[bounds[k] : bounds[k + 1]]
        table = pa.table(
            {
                "id": pa.array(part, pa.int64()),
                "x": pa.array(part / 2, pa.float32()),
                "arr": pa.array([[float(i), float(-i)] for i in part], pa.list_(pa.float32())),
            }
        )
        store.makedirs(path)
        pq.write_table(table, f"{path}/part-{k:03d}.parquet", row_group_size=row_group)
    return DatasetMetadata.from_parquet(store, path, feature_cols=["id", "arr"], label_cols=["x"])


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def read_epoch(store, meta, size, batch_size, **kw):
    """Batches of every rank for one epoch: {rank: [batch, ...]}."""
    out = {}
    for rank in range(size):
        reader = make_batch_reader(store, meta, rank=rank, size=size, batch_size=batch_size, **kw)
        out[rank] = list(reader)
        assert len(out[rank]) == reader.steps_per_epoch == len(reader)
    return out


@pytest.mark.parametrize(
    ("rows", "size", "batch_size"),
    [(120, 2, 10), (120, 3, 8), (101, 2, 8), (7, 3, 2), (100, 4, 32), (50, 1, 7)],
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_equal_full_batches_on_every_rank_and_every_row_read(
    store, rows, size, batch_size, shuffle
):
    meta = write_dataset(store, rows)
    epoch = read_epoch(store, meta, size, batch_size, shuffle=shuffle, seed=3)
    steps = {len(batches) for batches in epoch.values()}
    assert steps == {steps_per_epoch(rows, size, batch_size)}
    reads = Counter()
    for batches in epoch.values():
        for b in batches:
            assert len(b["id"]) == batch_size
            reads.update(b["id"].tolist())
    assert set(reads) == set(range(rows))  # every row at least once
    extra = sum(reads.values()) - rows
    assert 0 <= extra < size * batch_size
    if rows % (size * batch_size) == 0:
        assert extra == 0 and set(reads.values()) == {1}  # exactly once


def test_shards_are_contiguous_and_balanced(store):
    meta = write_dataset(store, 101, files=4, row_group=6)
    shards = [plan_shard(meta.train_files, r, 3) for r in range(3)]
    sizes = [sum(s.rows for s in shard) for shard in shards]
    assert sum(sizes) == 101 and max(sizes) - min(sizes) <= 1


def test_values_dtypes_and_shapes_follow_the_metadata(store):
    meta = write_dataset(store, 40)
    assert meta.shapes == {"id": (), "arr": (2,), "x": ()}
    (batch, *_) = read_epoch(store, meta, 1, 8, shuffle=True)[0]
    assert batch["arr"].shape == (8, 2) and batch["arr"].dtype == np.float32
    assert batch["x"].dtype == np.float32
    np.testing.assert_array_equal(batch["arr"][:, 0], batch["id"])
    np.testing.assert_array_equal(batch["arr"][:, 1], -batch["id"])
    np.testing.assert_allclose(batch["x"], batch["id"] / 2)


def ids_of(batches):
    return np.concatenate([b["id"] for b in batches]).tolist()


def test_shuffle_is_seeded_and_changes_each_epoch(store):
    meta = write_dataset(store, 200, files=2, row_group=10)

    def order(seed, epoch):
        reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, seed=seed)
        reader.set_epoch(epoch)
        return ids_of(reader)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != list(range(200))
    plain = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, shuffle=False)
    assert ids_of(plain) == list(range(200))


def test_iterating_again_runs_the_next_epoch(store):
    meta = write_dataset(store, 60)
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, seed=5, epoch=4)
    first, second = ids_of(reader), ids_of(reader)
    again = make_batch_reader(store, meta, rank=0, size=1, batch_size=10, seed=5, epoch=5)
    assert reader.epoch == 6 and second == ids_of(again) and first != second


def test_inmemory_cache_serves_later_epochs_without_the_files(store, tmp_path):
    meta = write_dataset(store, 64)
    reader = make_batch_reader(
        store, meta, rank=1, size=2, batch_size=8, inmemory_cache=True, shuffle=False
    )
    first = ids_of(reader)
    store.delete(store.get_train_data_path())
    assert ids_of(reader) == first


def test_changing_a_batch_in_place_never_reaches_the_cache(store):
    meta = write_dataset(store, 32)
    reader = make_batch_reader(
        store, meta, rank=0, size=1, batch_size=8, inmemory_cache=True, shuffle=False
    )
    for batch in reader:
        batch["x"] *= 0
        batch["arr"] -= 100
    batch = next(iter(reader))
    np.testing.assert_allclose(batch["x"], batch["id"] / 2)
    np.testing.assert_array_equal(batch["arr"][:, 0], batch["id"])


@pytest.mark.parametrize(("prefetch", "num_workers"), [(0, 1), (1, 1), (2, 3)])
def test_prefetch_and_workers_do_not_change_what_is_read(store, prefetch, num_workers):
    meta = write_dataset(store, 150, files=3, row_group=9)
    reference = read_epoch(store, meta, 2, 16, seed=9)
    got = read_epoch(store, meta, 2, 16, seed=9, prefetch=prefetch, num_workers=num_workers)
    for rank in (0, 1):
        assert ids_of(got[rank]) == ids_of(reference[rank])


def reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("spark_estimators-reader")]


def test_stopping_early_stops_the_background_thread(store):
    meta = write_dataset(store, 500, files=5, row_group=5)
    before = len(reader_threads())
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=4, prefetch=1, shuffle=False)
    it = iter(reader)  # 100 row groups of 5 rows: the thread waits on the full queue
    next(it)
    assert len(reader_threads()) == before + 1
    it.close()
    assert len(reader_threads()) == before


def test_errors_in_the_background_thread_reach_the_caller(store):
    meta = write_dataset(store, 40)

    def broken(frame):
        raise ValueError("bad transform")

    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=4, transformation_fn=broken)
    with pytest.raises(ValueError, match="bad transform"):
        list(reader)
    assert reader_threads() == []


def test_transformation_fn_sees_pandas_and_changes_the_batches(store):
    meta = write_dataset(store, 48)

    def transform(frame):
        frame["x"] = frame["x"] * 10
        frame["arr_sum"] = [float(a.sum()) for a in frame["arr"]]
        return frame

    reader = make_batch_reader(
        store, meta, rank=0, size=1, batch_size=6, transformation_fn=transform
    )
    for batch in reader:
        np.testing.assert_allclose(batch["x"], batch["id"] * 5)
        assert batch["arr"].shape == (6, 2)
        np.testing.assert_allclose(batch["arr_sum"], 0.0)


def test_stack_columns_makes_one_array(store):
    meta = write_dataset(store, 30)
    reader = make_batch_reader(
        store,
        meta,
        rank=0,
        size=1,
        batch_size=5,
        columns=["id", "x"],
        stack_columns={"features": ["id", "x"]},
        shuffle=False,
    )
    batch = next(iter(reader))
    assert list(batch) == ["features"]
    np.testing.assert_allclose(batch["features"], [[i, i / 2] for i in range(5)])


def test_rank_and_size_default_to_the_launcher_environment(store, monkeypatch):
    meta = write_dataset(store, 40)
    monkeypatch.setenv("SPARK_ESTIMATORS_RANK", "1")
    monkeypatch.setenv("SPARK_ESTIMATORS_SIZE", "2")
    reader = make_batch_reader(store, meta, batch_size=4, shuffle=False)
    assert (reader.rank, reader.size) == (1, 2)
    assert ids_of(reader)[:3] == [20, 21, 22]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "size": 2}, "need 0 <= rank < size"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"columns": ["nope"]}, r"\['nope'\] are not in the dataset"),
        ({"reader": "tfrecord"}, "reader='tfrecord'"),
        ({"size": 41}, "40 rows, fewer than the 41 ranks"),
        ({"split": "test"}, "split 'test'"),
    ],
)
def test_bad_reader_arguments_are_explained(store, kwargs, message):
    meta = write_dataset(store, 40)
    args = {"rank": 0, "size": 1, "batch_size": 4, **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        make_batch_reader(store, meta, **args)


def test_petastorm_reader_explains_how_to_get_it(store):
    pytest.importorskip("pyarrow")
    try:
        import petastorm  # noqa: F401

        pytest.skip("petastorm is installed: covered by the petastorm environment")
    except ImportError:
        pass
    meta = write_dataset(store, 10)
    with pytest.raises(ConfigurationError, match="requirements-petastorm.txt"):
        make_batch_reader(store, meta, rank=0, size=1, reader="petastorm")


def test_torch_batches_are_tensors_shaped_by_the_metadata(store):
    torch = pytest.importorskip("torch")
    meta = write_dataset(store, 40)
    reader = make_batch_reader(store, meta, rank=0, size=2, batch_size=4)
    batches = torch_batches(reader, shapes={"arr": (2, 1)}, dtypes={"id": torch.float32})
    assert len(batches) == 5
    seen = list(batches)
    assert len(seen) == 5
    first = seen[0]
    assert first["arr"].shape == (4, 2, 1) and first["arr"].dtype == torch.float32
    assert first["id"].dtype == torch.float32 and first["x"].shape == (4,)
    torch.testing.assert_close(first["arr"][:, 0, 0], first["id"])


@pytest.mark.timeout(120)
def test_tf_dataset_feeds_keras_shaped_batches_one_epoch_per_pass(store):
    tf = pytest.importorskip("tensorflow")
    meta = write_dataset(store, 48)
    reader = make_batch_reader(store, meta, rank=0, size=2, batch_size=6, seed=1)
    ds = __import__("spark_estimators.data", fromlist=["tf_dataset"]).tf_dataset(
        reader, ["arr", "id"], ["x"]
    )
    (x_arr, x_id), y = ds.element_spec
    assert tuple(x_arr.shape) == (6, 2) and tuple(y.shape) == (6,) and y.dtype == tf.float32
    assert int(ds.cardinality()) == 4
    epochs = [[int(i) for (_, ids), _ in ds for i in ids.numpy()] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(24))
    assert epochs[0] != epochs[1]  # the second pass is the next epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("rows", "size", "batch_size"), [(120, 2, 10), (101, 2, 8)])
def test_petastorm_reader_keeps_the_equal_steps_contract(store, rows, size, batch_size):
    pytest.importorskip("petastorm", reason="petastorm runs in its own pinned environment only")
    meta = write_dataset(store, rows, files=4, row_group=7)
    # The dummy pool reads in order, so one epoch covers every row (the thread and process pools
    # may return a row group late, into the next epoch: tests/petastorm_env).
    epoch = read_epoch(store, meta, size, batch_size, reader="petastorm", seed=2, pool_type="dummy")
    reads = Counter()
    # petastorm shards by row group: the steps come from the largest shard, equal on every rank.
    assert len({len(batches) for batches in epoch.values()}) == 1
    for batches in epoch.values():
        assert len(batches) >= steps_per_epoch(rows, size, batch_size)
        for b in batches:
            assert b["arr"].shape == (batch_size, 2) and b["arr"].dtype == np.float32
            np.testing.assert_array_equal(b["arr"][:, 1], -b["id"])
            reads.update(b["id"].tolist())
    assert set(reads) == set(range(rows))


@pytest.mark.parametrize("shuffle", [True, False])
def test_memory_is_bounded_by_the_buffer_not_the_data(store, monkeypatch, shuffle):
    import spark_estimators.data.reader as reader_module

    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 200)  # 20-byte rows: blocks of 10 -> 16
    meta = write_dataset(store, 6000, files=3, row_group=1000)
    reader = make_batch_reader(
        store,
        meta,
        rank=0,
        size=1,
        batch_size=16,
        shuffle=shuffle,
        shuffle_buffer_size=300,
        prefetch=1,
        num_workers=2,
    )
    assert reader.block_rows == 16
    assert len(ids_of(reader)) == 6000
    buffer = 300 if shuffle else 0
    bound = buffer + (reader.prefetch + 2) * (reader.block_rows + reader.batch_size)
    # Held at once: the shuffle buffer (when shuffling) plus a few blocks, never the 6000 rows.
    assert buffer < reader.held_rows_peak <= bound


def test_files_changed_after_preparation_are_reported(store):
    from spark_estimators.errors import StoreError

    meta = write_dataset(store, 40, files=2, row_group=7)
    path = meta.train_files[0].path
    table = pq.read_table(path)
    pq.write_table(table, path, row_group_size=5)  # same rows, other row groups
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=4, shuffle=False)
    with pytest.raises(StoreError, match="has another row count than the dataset metadata"):
        list(reader)
    assert reader_threads() == []


def test_read_ahead_only_when_the_rank_has_cores_to_spare(monkeypatch):
    import os

    from spark_estimators.data.reader import _readahead_blocks

    monkeypatch.setenv("SPARK_ESTIMATORS_LOCAL_SIZE", str(10 * (os.cpu_count() or 1)))
    assert _readahead_blocks(2) == 1  # the host's ranks fill its cores
    monkeypatch.setenv("SPARK_ESTIMATORS_LOCAL_SIZE", "1")
    assert _readahead_blocks(1) == 1  # one decode thread: nothing to overlap
    assert _readahead_blocks(2) == (4 if (os.cpu_count() or 1) >= 2 else 1)


def test_a_wrap_around_pass_without_shuffle_decodes_only_the_rows_it_needs(store, monkeypatch):
    from spark_estimators.data._scan import OrderedScan

    decoded = []
    read_piece = OrderedScan.read_piece

    def counting(self, piece):
        for batch in read_piece(self, piece):
            decoded.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(OrderedScan, "read_piece", counting)
    meta = write_dataset(store, 100, files=2, row_group=50)
    reader = make_batch_reader(
        store, meta, rank=0, size=1, batch_size=16, shuffle=False, num_workers=2
    )
    ids = ids_of(reader)
    # 7 batches of 16 = 112 rows: the 100 rows in order, then the first 12 again.
    assert ids == list(range(100)) + list(range(12))
    # The second pass decodes those 12 rows, not a row group (or two, one per decode thread).
    assert sum(decoded) == 112


def test_a_wrap_around_pass_reads_on_when_transformation_fn_drops_its_first_rows(store):
    meta = write_dataset(store, 100, files=2, row_group=50)

    def drop_first(frame):
        return frame[frame["id"] >= 30]  # 70 of 100 rows: 7 batches of 16 need 42 more

    reader = make_batch_reader(
        store, meta, rank=0, size=1, batch_size=16, shuffle=False, transformation_fn=drop_first
    )
    ids = ids_of(reader)
    # The second pass starts over: rows 0-29 are dropped again, rows 30-71 fill the epoch (a
    # pass cut at the 42 rows still needed would have given none: "a pass gave no rows").
    assert ids == list(range(30, 100)) + list(range(30, 72))


def wait_until_blocked_on_put(q):
    """Until a thread waits for room in the full queue ``q`` (a condition, not a sleep)."""
    import time

    deadline = time.monotonic() + 60
    while not q.not_full._waiters:
        assert time.monotonic() < deadline, "the producer never blocked on its full queue"
        time.sleep(0.001)


def test_stopping_does_not_wait_for_a_producer_blocked_on_a_full_queue(monkeypatch):
    import queue
    import time

    import spark_estimators.data._scan as scan_module
    from spark_estimators.data._pipeline import Prefetcher
    from spark_estimators.data._scan import put_unless_stopped, stop_producers

    # A blocked producer polls for the stop this often: make the poll long enough to tell.
    monkeypatch.setattr(scan_module, "_POLL_SECONDS", 30.0)
    q = queue.Queue(maxsize=1)
    q.put("full")
    stop = threading.Event()
    worker = threading.Thread(target=put_unless_stopped, args=(q, "item", stop))
    worker.start()
    wait_until_blocked_on_put(q)
    t0 = time.perf_counter()
    stop_producers(stop, [q])
    worker.join(timeout=20)
    assert not worker.is_alive() and time.perf_counter() - t0 < 10  # not the 30 s poll

    # The reader's prefetch thread, blocked with a group nobody takes, ends as promptly.
    prefetcher = Prefetcher(iter(range(10)), depth=1)
    items = prefetcher.__enter__()
    assert next(items) == 0
    wait_until_blocked_on_put(prefetcher._queue)
    t0 = time.perf_counter()
    prefetcher.__exit__(None, None, None)
    assert time.perf_counter() - t0 < 10 and reader_threads() == []
