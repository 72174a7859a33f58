"""Store.create dispatch, HDFS URL parsing, DBFS path rules and configuration errors."""

from __future__ import annotations

import pickle

import pytest

from spark_estimators.errors import ConfigurationError
from spark_estimators.store import (
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    Store,
)
from spark_estimators.store._filesystems import HadoopFilesystemSpec, parse_hdfs_url
from spark_estimators.store.local import dbfs_local_path


@pytest.mark.parametrize(
    ("url", "cls", "prefix"),
    [
        ("/tmp/exp", LocalStore, "/tmp/exp"),
        ("file:///tmp/exp", LocalStore, "/tmp/exp"),
        ("file:/tmp/exp/", LocalStore, "/tmp/exp"),
        ("hdfs://nn:8020/user/me", HDFSStore, "hdfs://nn:8020/user/me"),
        ("hdfs:///user/me", HDFSStore, "hdfs:///user/me"),
        ("s3://bucket/exp/", FilesystemStore, "s3://bucket/exp"),
        ("s3a://bucket/exp", FilesystemStore, "s3a://bucket/exp"),
        ("dbfs:/ml/exp", DBFSLocalStore, "/dbfs/ml/exp"),
    ],
)
def test_create_picks_the_class_by_scheme(url, cls, prefix):
    store = Store.create(url)
    assert type(store) is cls
    assert store.prefix_path == prefix


def test_relative_local_prefix_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Store.create("exp").prefix_path == str(tmp_path / "exp")


@pytest.mark.parametrize("url", ["/dbfs/ml/exp", "file:///dbfs/ml/exp", "file:/dbfs/ml/exp"])
def test_dbfs_fuse_paths_follow_the_databricks_rules(url, monkeypatch):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert type(Store.create(url)) is LocalStore  # elsewhere they are plain local paths
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    store = Store.create(url)
    assert type(store) is DBFSLocalStore
    assert store.prefix_path == "/dbfs/ml/exp"


@pytest.mark.parametrize(
    ("path", "local"),
    [
        ("dbfs:/a/b", "/dbfs/a/b"),
        ("/dbfs/a/b", "/dbfs/a/b"),
        ("file:///dbfs/a/b", "/dbfs/a/b"),
        ("file:/dbfs/a/b", "/dbfs/a/b"),
    ],
)
def test_dbfs_forms_map_to_the_fuse_path(path, local):
    assert dbfs_local_path(path) == local


def test_dbfs_store_resolves_dbfs_urls_under_its_fuse_root(dbfs_root):
    store = DBFSLocalStore("dbfs:/exp")
    assert store.prefix_path == f"{dbfs_root}/exp"
    store.write_text("dbfs:/exp/a.txt", "x")
    assert (dbfs_root / "exp" / "a.txt").read_text() == "x"
    view = pickle.loads(pickle.dumps(store.to_remote("r")))
    assert view.read_text("/dbfs/exp/a.txt") == "x"  # the root travels with the view


@pytest.mark.parametrize(
    ("url", "host", "port", "path"),
    [
        ("hdfs://namenode01:8020/user/test/exp", "namenode01", 8020, "/user/test/exp"),
        ("hdfs://nameservice1/user/test", "nameservice1", None, "/user/test"),
        ("hdfs:///user/test/exp", None, None, "/user/test/exp"),
        ("/user/test/exp", None, None, "/user/test/exp"),
        ("HDFS://nn:9000/x", "nn", 9000, "/x"),
    ],
)
def test_parse_hdfs_url(url, host, port, path):
    parsed = parse_hdfs_url(url)
    assert (parsed.host, parsed.port, parsed.path) == (host, port, path)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bucket/x", "not an HDFS URL"),
        ("hdfs://nn:8020", "has no path"),
        ("hdfs://nn:80x0/p", "bad port '80x0'"),
        ("relative/path", "not an HDFS URL"),
    ],
)
def test_bad_hdfs_urls_are_refused(url, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_hdfs_url(url)


def test_hdfs_store_takes_host_and_port_from_url_or_arguments():
    store = HDFSStore("hdfs://nn:8020/user/me/exp", user="me")
    assert store.hdfs_kwargs == {"host": "nn", "port": 8020, "user": "me"}
    assert store.get_logs_path("r") == "hdfs://nn:8020/user/me/exp/runs/r/logs"
    assert store.fs_path(store.get_logs_path("r")) == "/user/me/exp/runs/r/logs"
    assert store.full_path("/other/place") == "hdfs://nn:8020/other/place"
    plain = HDFSStore("/user/me/exp", host="nn2", port=9000)
    assert plain.hdfs_kwargs == {"host": "nn2", "port": 9000, "user": None}
    assert plain.get_run_path("r") == "hdfs:///user/me/exp/runs/r"
    default = HDFSStore("hdfs:///user/me")
    assert default.hdfs_kwargs["host"] == "default" and default.hdfs_kwargs["port"] == 0


def test_hdfs_store_connects_lazily_and_its_view_pickles():
    store = HDFSStore("hdfs://nn:8020/user/me", extra_conf={"dfs.replication": "1"})
    assert isinstance(store.filesystem_spec, HadoopFilesystemSpec)
    view = pickle.loads(pickle.dumps(store.to_remote("r")))
    assert view.get_checkpoint_path() == "hdfs://nn:8020/user/me/runs/r/checkpoints"


def test_unknown_scheme_names_the_valid_ones():
    with pytest.raises(ConfigurationError, match=r"unknown store scheme 'foo'.*'hdfs'.*'s3'"):
        Store.create("foo://bucket/x")


@pytest.mark.parametrize(("url", "package"), [("gs://b/x", "gcsfs"), ("abfs://c/x", "adlfs")])
def test_missing_optional_library_names_the_pip_package(url, package):
    pytest.importorskip("s3fs")
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ConfigurationError, match=f"pip install {package}"):
        Store.create(url)


def test_filesystem_store_refuses_plain_paths_and_mixed_schemes():
    with pytest.raises(ConfigurationError, match="needs a URL with a scheme"):
        FilesystemStore("/tmp/x")
    with pytest.raises(ConfigurationError, match="train_path='gs://other/t' must be a s3://"):
        FilesystemStore("s3://bucket/x", train_path="gs://other/t")


def test_layout_overrides_follow_horovod(tmp_path):
    store = LocalStore(
        str(tmp_path / "exp"),
        train_path=str(tmp_path / "train"),
        val_path=str(tmp_path / "val"),
    )
    assert store.get_train_data_path() == str(tmp_path / "train")
    assert store.get_train_data_path(2) == str(tmp_path / "train") + ".2"
    assert store.get_val_data_path() == str(tmp_path / "val")
    assert store.get_runs_path() == str(tmp_path / "exp" / "runs")


@pytest.mark.parametrize("bad", ["", "a/b", "..", None])
def test_run_ids_must_be_single_path_components(bad, tmp_path):
    store = LocalStore(str(tmp_path))
    with pytest.raises(ConfigurationError, match="run_id"):
        store.get_run_path(bad)


def test_non_dbfs_path_is_refused_by_dbfs_store():
    with pytest.raises(ConfigurationError, match="not a DBFS path"):
        DBFSLocalStore("/tmp/x")


def test_storage_options_are_accepted_empty_and_refused_where_meaningless(tmp_path):
    assert type(Store.create(str(tmp_path), storage_options=None)) is LocalStore
    with pytest.raises(ConfigurationError, match="storage_options only apply to fsspec stores"):
        Store.create(str(tmp_path), storage_options={"key": "k"})


def test_horovods_dbfs_path_helpers():
    # horovod's test_dbfs_local_store, on DBFSLocalStore's class and static methods
    for url in ("dbfs:/tmp/a1", "/dbfs/tmp/a1", "file:///dbfs/tmp/a1", "file:/dbfs/tmp/a1"):
        assert DBFSLocalStore.matches_dbfs(url)
        assert DBFSLocalStore.normalize_path(url) == "/dbfs/tmp/a1"
    assert not DBFSLocalStore.matches_dbfs("dbfs://tmp/test_local_dir3")
    assert not DBFSLocalStore.matches_dbfs("/tmp/dbfs/a")
    with pytest.raises(ValueError, match="not a DBFS path"):
        DBFSLocalStore.normalize_path("dbfs://tmp/a1")


def test_horovods_hdfs_full_and_localized_paths():
    # horovod's test_hdfs_store_parse_url (no connection is made)
    store = HDFSStore("hdfs://namenode01:8020/user/test/output")
    assert store.get_full_path("/output") == "hdfs://namenode01:8020/output"
    assert store.get_full_path("/user/test/output") == "hdfs://namenode01:8020/user/test/output"
    assert (
        store.get_localized_path("hdfs://namenode01:8020/user/test/output") == "/user/test/output"
    )
    for root in ("hdfs:///user/test/output", "/user/test/output"):
        store = HDFSStore(root)
        assert store.get_full_path("/user/test/output") == "hdfs:///user/test/output"
        assert store.get_localized_path("hdfs:///user/test/output") == "/user/test/output"


def test_local_paths_are_filesystem_stores_as_in_horovod(tmp_path):
    # horovod: Store.create("/dbfs/tmp/x") off Databricks is a FilesystemStore
    assert isinstance(Store.create(str(tmp_path / "dbfs" / "tmp")), FilesystemStore)
    assert isinstance(LocalStore(str(tmp_path)), FilesystemStore)
    assert LocalStore(str(tmp_path)).storage_options == {}
    assert LocalStore(str(tmp_path)).get_full_path("x") == (tmp_path / "x").as_uri()
