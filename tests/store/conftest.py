"""Store fixtures: a real S3-API server (moto) on 127.0.0.1, and one store of every kind."""

from __future__ import annotations

import logging
import uuid

import pytest

S3_KEY = "testing-key"
S3_SECRET = "testing-secret-do-not-log"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's server mode, started in a thread on a free port of 127.0.0.1."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_storage_options(endpoint: str) -> dict:
    return {
        "key": S3_KEY,
        "secret": S3_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


@pytest.fixture
def s3_bucket(s3_endpoint):
    import boto3

    name = f"bucket-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def dbfs_root(tmp_path, monkeypatch):
    """A temp dir standing in for the /dbfs FUSE mount."""
    from spark_estimators.store import local

    root = tmp_path / "dbfs"
    root.mkdir()
    monkeypatch.setattr(local, "DBFS_FUSE_ROOT", str(root))
    return root


STORE_KINDS = ["local", "fsspec-file", "s3", "dbfs"]


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path):
    """One store of each kind that can run here, each on a fresh prefix."""
    from spark_estimators.store import DBFSLocalStore, FilesystemStore, LocalStore, Store

    kind = request.param
    if kind == "local":
        return LocalStore(str(tmp_path / "local-store"))
    if kind == "fsspec-file":
        return FilesystemStore(f"file://{tmp_path}/fsspec-store")
    if kind == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        return Store.create(
            f"s3://{bucket}/experiments", storage_options=s3_storage_options(endpoint)
        )
    request.getfixturevalue("dbfs_root")
    return DBFSLocalStore("dbfs:/ml/experiments")
