"""core/rank.py and core/batches.py: the rank-side protocol every estimator shares (issue 19)."""

from __future__ import annotations

import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimators import envvars as ev
from spark_estimators.core import rank as protocol
from spark_estimators.core import tensors
from spark_estimators.core.batches import BatchConverter, epoch_batches
from spark_estimators.core.checkpoint import read_info
from spark_estimators.data import DatasetMetadata, make_batch_reader
from spark_estimators.store import LocalStore


# -- metrics ---------------------------------------------------------------------------------------
def test_epoch_sums_weight_each_batch_by_its_rows():
    sums = protocol.EpochSums(2)
    sums.add(1.0, 4.0, [0.5, 2.0])
    sums.add(3.0, 2.0, [1.0, 5.0])
    np.testing.assert_array_equal(sums.vector(), [10.0, 6.0, 4.0, 18.0])
    assert sums.vector().dtype == np.float64


def test_means_over_ranks_weight_ranks_by_their_rows():
    # rank 0 saw 6 rows with loss 2.0 and mae 1.0; rank 1 saw 2 rows with loss 6.0 and mae 3.0
    rank0, rank1 = protocol.EpochSums(1), protocol.EpochSums(1)
    rank0.add(2.0, 6.0, [1.0])
    rank1.add(6.0, 2.0, [3.0])
    means = protocol.epoch_means(rank0.vector() + rank1.vector())  # what the Sum allreduce gives
    assert means == [3.0, 1.5]  # (12 + 12) / 8, (6 + 6) / 8, not the plain mean 4.0, 2.0


def test_means_of_an_epoch_without_rows_are_zero_not_a_division_error():
    assert protocol.epoch_means([0.0, 0.0, 0.0]) == [0.0, 0.0]


def test_epoch_logs_name_train_and_val_values():
    logs = protocol.epoch_logs(3, ["mae", "acc"], [0.5, 0.25, 0.75], [0.625, 0.375, 0.5])
    assert logs == {
        "epoch": 3,
        "loss": 0.5,
        "mae": 0.25,
        "acc": 0.75,
        "val_loss": 0.625,
        "val_mae": 0.375,
        "val_acc": 0.5,
    }
    assert protocol.epoch_logs(0, [], [1.5]) == {"epoch": 0, "loss": 1.5}


@pytest.fixture
def job_of_one(monkeypatch):
    """A real collective job of one over gloo in this process."""
    import spark_estimators.collective as hvd

    for name in (ev.SE_RANK, ev.SE_SIZE, ev.SE_MASTER_ADDR, ev.SE_MASTER_PORT, ev.SE_BACKEND):
        monkeypatch.delenv(name, raising=False)
    hvd.init(backend="gloo")
    try:
        yield hvd
    finally:
        hvd.shutdown()


def test_average_over_ranks_and_stop_together_in_a_real_job(job_of_one):
    sums = protocol.EpochSums(1)
    sums.add(2.0, 3.0, [4.0])
    sums.add(5.0, 1.0, [8.0])
    assert protocol.average_over_ranks(sums) == [2.75, 5.0]
    assert protocol.stop_together(True) is True
    assert protocol.stop_together(False) is False


# -- readers ---------------------------------------------------------------------------------------
def spec_like(**changes):
    fields = dict(
        feature_cols=["id", "img"],
        label_cols=["y"],
        sample_weight_col=None,
        batch_size=6,
        val_batch_size=4,
        shuffle=True,
        shuffle_buffer_size=None,
        seed=None,
        inmemory_cache_all=True,
        train_reader_num_workers=3,
        val_reader_num_workers=1,
        reader="arrow",
        reader_pool_type="thread",
        transformation_edit_fields=None,
        transformation_removed_fields=None,
    )
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def test_reader_options_of_the_train_and_val_splits():
    fn = str.upper  # any transformation_fn; only passed on
    train = protocol.reader_options(spec_like(sample_weight_col="w"), "train", fn)
    assert (train.batch_size, train.shuffle, train.seed, train.num_workers) == (6, True, 0, 3)
    assert train.columns == ("id", "img", "y", "w") and train.transformation_fn is fn
    assert train.inmemory_cache and train.shuffle_buffer_size is None and train.reader == "arrow"
    val = protocol.reader_options(spec_like(seed=7), "val", None)
    assert (val.batch_size, val.shuffle, val.seed, val.num_workers) == (4, False, 7, 1)
    assert val.columns == ("id", "img", "y")
    # shuffle_buffer_size=0 turns shuffling off; a size is passed on
    assert not protocol.reader_options(spec_like(shuffle_buffer_size=0), "train", None).shuffle
    sized = protocol.reader_options(spec_like(shuffle_buffer_size=12), "train", None)
    assert sized.shuffle and sized.shuffle_buffer_size == 12


def test_open_readers_give_this_ranks_shards(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    meta = write_rows(store, 40)
    spec = spec_like(store=store, meta=meta, shuffle=False)
    train, val = protocol.open_readers(spec, 1, 2, None)
    assert val is None  # no val split in the data
    assert (train.rank, train.size, train.batch_size, train.steps_per_epoch) == (1, 2, 6, 4)
    first = next(iter(train))
    assert first["id"].tolist() == [20, 21, 22, 23, 24, 25]  # rank 1 owns rows 20..39


# -- steps, learning rate, result ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reader_steps", "limit", "multiple", "expected"),
    [(10, None, 1, 10), (10, 4, 1, 4), (10, 40, 1, 10), (10, None, 4, 12), (2, 5, 3, 3)],
)
def test_steps_per_epoch(reader_steps, limit, multiple, expected):
    reader = types.SimpleNamespace(steps_per_epoch=reader_steps)
    assert protocol.epoch_steps(reader, limit, multiple) == expected


@pytest.mark.parametrize(
    ("scale_lr", "saved", "size", "factor"),
    [
        (True, 4, 2, 0.5),
        (True, 2, 3, 1.5),
        (True, 2, 2, 1.0),
        (False, 4, 2, 1.0),
        (True, None, 2, 1.0),
    ],
)
def test_lr_rescale_for_another_number_of_ranks(scale_lr, saved, size, factor):
    assert protocol.lr_rescale(scale_lr, saved, size) == factor


def test_rank_zero_result_carries_history_shapes_and_payload():
    history = [{"epoch": 0, "loss": 1.0}]
    result = protocol.rank_result(0, "abc", history, [(), (3,)], state_dict={"w": 1})
    assert result == {
        "rank": 0,
        "fingerprint": "abc",
        "history": history,
        "output_shapes": [(), (3,)],
        "state_dict": {"w": 1},
    }
    other = protocol.rank_result(1, "abc", history, [(3,)], state_dict=None)
    assert other == {"rank": 1, "fingerprint": "abc"}


def test_row_shapes_of_numpy_and_torch_outputs():
    torch = pytest.importorskip("torch")
    outputs = (np.zeros((4, 1)), torch.zeros(4, 2, 3), np.zeros(4))
    assert protocol.row_shapes(outputs) == [(), (2, 3), ()]
    assert protocol.row_shapes(torch.zeros(5, 7)) == [(7,)]


def test_commit_epoch_writes_the_one_schema(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    history = [{"epoch": 0, "loss": 1.0}, {"epoch": 1, "loss": 0.5}]
    protocol.commit_epoch(store, "r1", "torch", 1, 2, history, "f" * 64, {"note": "x"})
    info = read_info(store, "r1", "torch")
    assert info is not None
    assert (info.framework, info.epoch, info.num_proc) == ("torch", 1, 2)
    assert list(info.history) == history and info.fingerprint == "f" * 64
    assert dict(info.extra) == {"note": "x"}


# -- the one batch converter -----------------------------------------------------------------------
ARRAYS = {
    "img": np.arange(32.0).reshape(2, 16),
    "x": np.array([1.5, 2.5]),
    "y": np.array([0, 1]),
    "w": np.array([1.0, 2.0]),
}


@pytest.mark.parametrize(
    ("features_as_column", "labels_as_column", "x_shape", "y_shape"),
    [(True, False, (2, 1), (2,)), (False, False, (2,), (2,)), (True, True, (2, 1), (2, 1))],
    ids=["torch", "lightning", "keras"],
)
@pytest.mark.parametrize("shape", [[-1, 1, 4, 4], [1, 4, 4]], ids=["horovod-full", "per-row"])
def test_every_framework_gets_transforms_shapes(
    shape, features_as_column, labels_as_column, x_shape, y_shape
):
    convert = BatchConverter(
        ["img", "x"],
        ["y"],
        "w",
        [shape, None],
        None,
        scalar_features_as_column=features_as_column,
        scalar_labels_as_column=labels_as_column,
        to_torch=False,
    )
    out = convert(ARRAYS)
    fed = tensors.model_inputs(ARRAYS, ["img"], [shape])[0]  # what transform() feeds
    assert out["img"].shape == fed.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(out["img"], fed)
    assert (out["x"].shape, out["x"].dtype) == (x_shape, np.float32)
    assert (out["y"].shape, out["y"].dtype) == (y_shape, np.int64)
    assert (out["w"].shape, out["w"].dtype) == ((2,), np.float32)
    assert all(a.flags.c_contiguous and a.flags.writeable for a in out.values())


def write_rows(store, rows: int) -> DatasetMetadata:
    path = store.get_train_data_path()
    ids = np.arange(rows)
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "img": pa.array([[float(i)] * 4 for i in ids], pa.list_(pa.float32())),
            "y": pa.array(ids / 2, pa.float64()),
        }
    )
    store.makedirs(path)
    pq.write_table(table, f"{path}/part-000.parquet", row_group_size=7)
    return DatasetMetadata.from_parquet(store, path, feature_cols=["id", "img"], label_cols=["y"])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_epoch_batches_are_converted_blocks_sliced_into_steps(tmp_path, prefetch):
    torch = pytest.importorskip("torch")
    store = LocalStore(str(tmp_path / "store"))
    meta = write_rows(store, 40)
    reader = make_batch_reader(store, meta, rank=0, size=1, batch_size=6, prefetch=prefetch)
    convert = BatchConverter(["id", "img"], ["y"], None, [None, [-1, 2, 2]], None)
    plain = make_batch_reader(store, meta, rank=0, size=1, batch_size=6, prefetch=prefetch)
    plain.set_epoch(2)
    expected = [convert(b) for b in plain][:4]  # the same epoch, converted batch by batch
    got = list(epoch_batches(reader, convert, steps=4, epoch=2))
    assert len(got) == 4 and reader.epoch == 3
    for batch, want in zip(got, expected, strict=True):
        assert batch["img"].shape == (6, 2, 2) and batch["id"].shape == (6, 1)
        assert batch["y"].dtype == torch.float32 and batch["id"].dtype == torch.int64
        for col in want:
            torch.testing.assert_close(batch[col], want[col])
    # steps=None runs the whole epoch
    assert len(list(epoch_batches(reader, convert))) == reader.steps_per_epoch == 7


@pytest.mark.parametrize("shuffle", [False, True])
def test_steps_beyond_the_epoch_wrap_around_the_shard(tmp_path, shuffle):
    # issue 25: 4 rows, 2 ranks, batch 1, backward_passes_per_step=3 -> 3 steps of a 2-step epoch
    # raised "generator raised StopIteration"; now the third step starts the epoch's order again.
    pytest.importorskip("torch")
    store = LocalStore(str(tmp_path / "store"))
    meta = write_rows(store, 4)
    convert = BatchConverter(["id", "img"], ["y"])
    for rank, shard in ((0, {0, 1}), (1, {2, 3})):
        reader = make_batch_reader(
            store, meta, rank=rank, size=2, batch_size=1, shuffle=shuffle, seed=3
        )
        steps = protocol.epoch_steps(reader, None, multiple=3)
        assert (reader.steps_per_epoch, steps) == (2, 3)
        for epoch in (0, 1):
            ids = [int(b["id"][0, 0]) for b in epoch_batches(reader, convert, steps, epoch)]
            assert len(ids) == 3 and set(ids) == shard  # every row of the shard, one again
            assert ids[2] == ids[0]  # the wrap starts the epoch's order again
            assert reader.epoch == epoch + 1
    # 7 reader steps, 3 passes per step: 9 steps, the last two wrap (rows 0..5 of rank 0's 7)
    reader = make_batch_reader(
        store, write_rows(store, 14), rank=0, size=2, batch_size=1, shuffle=False
    )
    steps = protocol.epoch_steps(reader, None, multiple=3)
    ids = [int(b["id"][0, 0]) for b in epoch_batches(reader, convert, steps, 0)]
    assert steps == 9 and ids == [0, 1, 2, 3, 4, 5, 6, 0, 1]


# -- compute threads per rank ---------------------------------------------------------------------
def test_cpu_share_splits_this_process_cores_among_the_hosts_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(protocol.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [protocol.cpu_share(n) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice (e.g. the estimator's env)
    assert protocol.cpu_share(2) is None


def test_size_torch_threads_gives_torch_the_share_and_leaves_a_users_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(protocol.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    try:
        protocol.size_torch_threads(2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(3)
        protocol.size_torch_threads(2)
        assert torch.get_num_threads() == 3  # untouched
    finally:
        torch.set_num_threads(before)
