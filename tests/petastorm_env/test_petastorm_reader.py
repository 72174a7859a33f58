"""reader="petastorm": horovod's petastorm settings mean what horovod documents (issue 30).

Runs in the pinned petastorm environment (``make test-petastorm``: pyspark 4.0.5, pyarrow 14,
numpy 1.26); in the main environment petastorm is absent and the module is skipped. The default
reader's answer to each setting (same meaning, or a clear refusal naming the alternative) is
tested here too, since it is the same table in docs/store_and_data.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators.data import DatasetMetadata, ReaderOptions, make_batch_reader
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore

petastorm = pytest.importorskip(
    "petastorm", reason="petastorm runs in its own pinned environment (make test-petastorm)"
)

pytestmark = [pytest.mark.petastorm, pytest.mark.timeout(120)]


def write_dataset(store, rows, files=4, row_group=8):
    """``rows`` rows: id, x = id / 2 and arr = [id, -id], over ``files`` files."""
    path = store.get_train_data_path()
    store.makedirs(path)
    ids = np.arange(rows)
    for k, part in enumerate(np.array_split(ids, files)):
        table = pa.table(
            {
                "id": pa.array(part, pa.int64()),
                "x": pa.array(part / 2, pa.float32()),
                "arr": pa.array([[float(i), float(-i)] for i in part], pa.list_(pa.float32())),
            }
        )
        pq.write_table(table, f"{path}/part-{k:03d}.parquet", row_group_size=row_group)
    return DatasetMetadata.from_parquet(store, path, feature_cols=["id", "arr"], label_cols=["x"])


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def epoch_ids(reader):
    batches = list(reader)
    assert len(batches) == reader.steps_per_epoch
    for b in batches:
        assert len(b["id"]) == reader.batch_size
    return [int(i) for b in batches for i in b["id"]]


def read_all_ranks(store, meta, size, batch_size, **kw):
    """One epoch of every rank: {rank: [ids in order]}."""
    return {
        r: epoch_ids(
            make_batch_reader(
                store, meta, rank=r, size=size, batch_size=batch_size, reader="petastorm", **kw
            )
        )
        for r in range(size)
    }


def shard_of(rank, size, rows, files, row_group):
    """The ids petastorm gives ``rank``: the row groups whose global index % size == rank."""
    groups = [
        part[k : k + row_group]
        for part in np.array_split(np.arange(rows), files)
        for k in range(0, len(part), row_group)
    ]
    return {int(i) for g in groups[rank::size] for i in g}


@pytest.mark.parametrize("pool_type", ["thread", "process", "dummy"])
def test_reader_pool_types_read_the_rank_shard(store, pool_type):
    # 4 files of 25 rows in row groups of 8: 16 groups of 8 or 1 rows, uneven shards.
    meta = write_dataset(store, 100, files=4, row_group=8)
    for rank in range(3):
        reader = make_batch_reader(
            store,
            meta,
            rank=rank,
            size=3,
            batch_size=8,
            reader="petastorm",
            pool_type=pool_type,
            num_workers=2,
            seed=1,
        )
        assert reader.steps_per_epoch == 5  # ceil(34 rows of the largest shard / 8), every rank
        shard = shard_of(rank, 3, 100, 4, 8)
        epochs = [epoch_ids(reader) for _ in range(3)]
        assert all(set(ids) <= shard for ids in epochs)  # only rows of its own shard
        if pool_type == "dummy":
            assert all(set(ids) == shard for ids in epochs)  # in order: every row every epoch
        else:
            # Row groups may come back late and fall into the next epoch, never get lost.
            assert set().union(*epochs) == shard


def test_fewer_row_groups_than_ranks_is_refused(store):
    meta = write_dataset(store, 16, files=1, row_group=16)
    with pytest.raises(ConfigurationError, match=r"1 row group\(s\) for 2 ranks.*reader='arrow'"):
        make_batch_reader(store, meta, rank=0, size=2, reader="petastorm")


def test_reader_pool_type_is_checked(store):
    meta = write_dataset(store, 16)
    with pytest.raises(ConfigurationError, match=r"reader_pool_type='fork'.*'thread', 'process'"):
        make_batch_reader(store, meta, reader="petastorm", pool_type="fork")


def test_shuffle_buffer_permutes_rows_beyond_row_groups(store):
    meta = write_dataset(store, 128, files=2, row_group=16)
    # Row groups shuffled but no buffer: each row group's 16 rows stay contiguous and in order.
    groups_only = epoch_ids(
        make_batch_reader(
            store, meta, rank=0, size=1, batch_size=8, reader="petastorm", shuffle_buffer_size=1
        )
    )
    runs = [groups_only[k : k + 16] for k in range(0, 128, 16)]
    assert all(run == list(range(run[0], run[0] + 16)) for run in runs)
    # A 64-row buffer mixes rows of different row groups inside a batch.
    mixed = epoch_ids(
        make_batch_reader(
            store, meta, rank=0, size=1, batch_size=8, reader="petastorm", shuffle_buffer_size=64
        )
    )
    assert sorted(mixed) == list(range(128))
    assert any(len({i // 16 for i in mixed[k : k + 8]}) > 1 for k in range(0, 128, 8))


def test_inmemory_cache_reads_the_files_once(store, tmp_path):
    meta = write_dataset(store, 60, files=3, row_group=10)
    reader = make_batch_reader(
        store, meta, rank=1, size=2, batch_size=8, reader="petastorm", inmemory_cache=True, seed=4
    )
    first = epoch_ids(reader)
    shard = shard_of(1, 2, 60, 3, 10)
    assert set(first) == shard
    # The files are gone: the later epochs can only come from the rank's cache.
    for f in meta.train_files:
        store.delete(f.path)
    second, third = epoch_ids(reader), epoch_ids(reader)
    assert len(first) == len(second) == reader.steps_per_epoch * 8
    assert set(second) == set(third) == shard  # every cached row, every epoch
    assert second != third  # a new permutation each epoch


def test_transformation_fn_is_a_transform_spec_with_edit_and_removed_fields(store):
    meta = write_dataset(store, 32)

    def fn(frame):
        frame["x"] = frame["x"] * 10  # change a column's values (no edit field needed)
        frame["id_sq"] = frame["id"] ** 2  # a new column: declared in edit_fields
        return frame.drop(columns=["arr"])  # a removed column: declared in removed_fields

    reader = make_batch_reader(
        store,
        meta,
        columns=["id", "x", "arr", "id_sq"],
        rank=0,
        size=1,
        batch_size=8,
        shuffle=False,
        reader="petastorm",
        transformation_fn=fn,
        transform_edit_fields=[("id_sq", np.int64, (), False)],
        transform_removed_fields=["arr"],
    )
    batch = next(iter(reader))
    assert set(batch) == {"id", "x", "id_sq"}
    np.testing.assert_array_equal(batch["id_sq"], batch["id"] ** 2)
    np.testing.assert_allclose(batch["x"], batch["id"] * 5.0)


def test_transform_spec_rejects_undeclared_columns_as_petastorm_does(store):
    meta = write_dataset(store, 16)

    def adds_a_column(frame):
        frame["extra"] = 1.0
        return frame

    reader = make_batch_reader(
        store,
        meta,
        rank=0,
        size=1,
        batch_size=4,
        reader="petastorm",
        transformation_fn=adds_a_column,
    )
    with pytest.raises(ValueError, match="do not match required schema"):
        next(iter(reader))


def test_the_default_reader_refuses_petastorm_only_settings_naming_the_alternative(store):
    meta = write_dataset(store, 16)
    with pytest.raises(ConfigurationError, match=r"pool_type='process'.*reader='petastorm'"):
        make_batch_reader(store, meta, pool_type="process")
    with pytest.raises(ConfigurationError, match=r"transform_edit_fields=.*add, change or drop"):
        ReaderOptions(transform_edit_fields=[("z", np.float32, (), False)])
    # The settings both readers share work on the default reader with the same meaning.
    cached = make_batch_reader(store, meta, batch_size=4, inmemory_cache=True, num_workers=3)
    assert sorted(epoch_ids(cached)) == list(range(16))
