"""One contract for every store here: local, fsspec file://, S3 (moto), DBFS (temp dir)."""

from __future__ import annotations

import os
import pickle

import pytest

from spark_estimators.errors import StoreError
from spark_estimators.store import FilesystemStore, LocalStore, RemoteStore, Store

S3_SECRET = "testing-secret-do-not-log"  # the one in conftest.py


def test_layout_paths_live_under_the_prefix(store):
    prefix = store.prefix_path
    assert store.get_run_path("r1") == f"{prefix}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{prefix}/runs/r1/checkpoints"
    assert store.get_logs_path("r1") == f"{prefix}/runs/r1/logs"
    assert store.get_train_data_path(3) == f"{prefix}/intermediate_train_data.3"
    assert store.get_val_data_path("ab") == f"{prefix}/intermediate_val_data.ab"
    assert store.get_test_data_path() == f"{prefix}/intermediate_test_data"
    assert store.get_dataset_metadata_path(3) == f"{prefix}/intermediate_train_data.3.metadata.json"


def test_bytes_and_text_round_trip_by_relative_and_full_path(store):
    payload = bytes(range(256)) * 1000
    store.write_bytes("a/b/data.bin", payload)
    assert store.read_bytes("a/b/data.bin") == payload
    assert store.read_bytes(store.full_path("a/b/data.bin")) == payload
    store.write_text(store.full_path("a/note.txt"), "héllo")
    assert store.read_text("a/note.txt") == "héllo"


def test_exists_isdir_listdir_stat_and_delete(store):
    store.write_text("d/one.txt", "1")
    store.write_text("d/sub/two.txt", "22")
    assert store.exists("d/one.txt") and not store.exists("d/none.txt")
    assert store.isdir("d") and not store.isdir("d/one.txt")
    assert store.listdir("d") == ["one.txt", "sub"]
    assert store.listdir("missing") == []
    st = store.stat("d/sub/two.txt")
    assert (st.size, st.is_dir) == (2, False)
    store.delete("d/one.txt")
    assert store.listdir("d") == ["sub"]
    store.delete("d")
    assert not store.exists("d/sub/two.txt") and store.listdir("d") == []
    store.delete("never/was")  # missing paths are ignored


def test_reading_a_missing_file_names_it(store):
    with pytest.raises(StoreError, match=r"nope\.bin.*does not exist"):
        store.read_bytes("nope.bin")


def test_atomic_write_replaces_whole_and_a_failed_write_keeps_the_old_file(store):
    path = store.get_checkpoint_path("run") + "/model.pt"
    store.write_bytes_atomic(path, b"old" * 1000)
    store.write_bytes(path, b"new" * 1000, atomic=True)
    assert store.read_bytes(path) == b"new" * 1000

    def crash_while_writing():
        with store.open_write(path, atomic=True) as out:
            out.write(b"partial")
            raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError, match="crash"):
        crash_while_writing()
    assert store.read_bytes(path) == b"new" * 1000
    assert store.listdir(store.get_checkpoint_path("run")) == ["model.pt"]  # no temp left


def test_open_read_is_seekable(store):
    store.write_bytes("f.bin", b"0123456789")
    with store.open_read("f.bin") as f:
        f.seek(5)
        assert f.read() == b"56789"


def test_sync_dir_uploads_new_and_changed_files_only(store, tmp_path):
    local = tmp_path / "local-logs"
    (local / "tb").mkdir(parents=True)
    (local / "tb" / "events.1").write_bytes(b"a" * 10)
    (local / "summary.json").write_text("{}")
    written = store.sync_dir(str(local), "run7", subdir="logs")
    logs = store.get_logs_path("run7")
    assert sorted(written) == [f"{logs}/summary.json", f"{logs}/tb/events.1"]
    assert store.read_bytes(f"{logs}/tb/events.1") == b"a" * 10
    assert store.sync_dir(str(local), "run7", subdir="logs") == []
    (local / "tb" / "events.1").write_bytes(b"b" * 20)
    assert store.sync_dir(str(local), "run7", subdir="logs") == [f"{logs}/tb/events.1"]
    assert store.read_bytes(f"{logs}/tb/events.1") == b"b" * 20


def test_list_and_delete_runs(store):
    for run in ("r1", "r2"):
        store.write_text(store.get_logs_path(run) + "/x.txt", run)
    assert store.list_runs() == ["r1", "r2"]
    store.delete_run("r1")
    assert store.list_runs() == ["r2"]
    with pytest.raises(ValueError, match="run_id"):
        store.delete_run("")


def test_list_and_delete_datasets(store):
    for idx in ("aa", "bb"):
        store.write_text(store.get_train_data_path(idx) + "/part-0.parquet", "x")
        store.write_text(store.get_val_data_path(idx) + "/part-0.parquet", "x")
    store.write_text(store.get_dataset_metadata_path("aa"), "{}")
    store.write_text(store.get_dataset_metadata_path("bb"), "{}")
    store.write_text(store.get_train_data_path("cc") + "/part-0.parquet", "x")  # incomplete
    assert store.list_datasets() == ["aa", "bb"]
    store.delete_dataset("aa")
    assert store.list_datasets() == ["bb"]
    assert not store.exists(store.get_train_data_path("aa") + "/part-0.parquet")
    assert not store.exists(store.get_val_data_path("aa"))


def test_remote_view_pickles_without_clients_and_shares_the_data(store):
    store.write_text("shared.txt", "from driver")
    _ = store.filesystem  # a live client on the driver must not travel
    view = store.to_remote("run3", dataset_idx="ab")
    blob = pickle.dumps(view)
    assert len(blob) < 4000
    remote = pickle.loads(blob)
    assert isinstance(remote, RemoteStore) and remote == view
    assert remote._fs is None
    assert remote.read_text("shared.txt") == "from driver"
    assert remote.get_checkpoint_path() == store.get_checkpoint_path("run3")
    assert remote.train_data_path == store.get_train_data_path("ab")
    remote.write_bytes_atomic(remote.get_checkpoint_path() + "/ckpt.pt", b"weights")
    assert store.read_bytes(store.get_checkpoint_path("run3") + "/ckpt.pt") == b"weights"


def test_store_itself_pickles(store):
    copy = pickle.loads(pickle.dumps(store))
    assert copy == store and type(copy) is type(store)


def test_secrets_never_appear_in_repr(store):
    view = store.to_remote("r")
    for text in (repr(store), str(store), repr(view), repr(store.filesystem_spec)):
        assert S3_SECRET not in text


def test_store_create_finds_the_same_place(store):
    url = getattr(store, "dbfs_path", None) or store.prefix_path
    options = getattr(store, "storage_options", None)
    again = Store.create(url, storage_options=options) if options else Store.create(url)
    store.write_text("probe.txt", "same place")
    assert again.read_text("probe.txt") == "same place"
    assert again.fs_path("probe.txt") == store.fs_path("probe.txt")


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_executors_write_through_the_remote_view(store, spark):
    view = store.to_remote("spark-run")

    def write_part(index, rows):
        data = ",".join(str(r) for r in rows).encode()
        view.write_bytes_atomic(f"{view.get_run_path()}/part-{index}.txt", data)
        yield (index, os.getpid())

    written = spark.sparkContext.parallelize(range(10), 2).mapPartitionsWithIndex(write_part)
    assert sorted(i for i, _ in written.collect()) == [0, 1]
    run = store.get_run_path("spark-run")
    assert store.listdir(run) == ["part-0.txt", "part-1.txt"]
    numbers = store.read_text(f"{run}/part-0.txt") + "," + store.read_text(f"{run}/part-1.txt")
    assert sorted(int(x) for x in numbers.split(",")) == list(range(10))


# -- horovod's names (issue 25) ------------------------------------------------------------------
def test_every_store_here_is_a_filesystem_store(store):
    # horovod: LocalStore (and DBFSLocalStore) subclass FilesystemStore
    assert isinstance(store, FilesystemStore)


def test_full_and_localized_paths_are_horovods(store):
    rel = "a/b/data.bin"
    store.write_bytes(rel, b"payload")
    full = store.get_full_path(rel)
    scheme = full.split("://", 1)[0]
    assert scheme == ("s3" if store.prefix_path.startswith("s3://") else "file")
    assert full.endswith("/a/b/data.bin") and "//" not in full.split("://", 1)[1][1:]
    # an absolute path or URL stays where it is; the localized path is the client's
    assert store.get_full_path(full) == full
    localized = store.get_localized_path(full)
    assert localized == store.get_localized_path(rel) == store.fs_path(rel)
    assert "://" not in localized
    assert store.filesystem.get_file_info(localized).size == len(b"payload")
    # read is read_bytes, by relative path, full URL or localized path
    assert store.read(rel) == store.read(full) == b"payload"
    if scheme == "file":
        assert localized.startswith("/") and full == "file://" + localized
    if isinstance(store, LocalStore):  # a local path is a path of the store (not of fsspec's)
        assert store.read(localized) == b"payload"


def test_parquet_dataset_checks_and_opens_through_the_store(store):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = store.get_train_data_path("pq")
    assert not store.is_parquet_dataset(path)  # missing
    store.write_text(path + "/README.txt", "not parquet")
    assert not store.is_parquet_dataset(path)  # no Parquet file in it
    with pytest.raises(StoreError, match=r"intermediate_train_data\.pq"):
        store.get_parquet_dataset(path + "/missing")
    table = pa.table({"x": [1, 2, 3], "y": [0.5, 1.5, 2.5]})
    for i in (0, 1):
        with store.open_write(f"{path}/part-{i}.parquet") as out:
            pq.write_table(table, out)
    store.delete(path + "/README.txt")
    assert store.is_parquet_dataset(path)
    assert store.is_parquet_dataset(store.get_full_path(path))
    assert store.is_parquet_dataset(f"{path}/part-0.parquet")
    dataset = store.get_parquet_dataset(path)
    assert sorted(dataset.read().column("x").to_pylist()) == [1, 1, 2, 2, 3, 3]
    remote = pickle.loads(pickle.dumps(store.to_remote("r")))  # executors have them too
    assert remote.is_parquet_dataset(path) and remote.read(f"{path}/part-1.parquet")
