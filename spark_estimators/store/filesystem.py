"""Stores on remote filesystems: FilesystemStore (fsspec: S3, GCS, Azure, ...) and HDFSStore."""

from __future__ import annotations

from collections.abc import Mapping

from spark_estimators.errors import ConfigurationError
from spark_estimators.store._filesystems import (
    FsspecFilesystemSpec,
    HadoopFilesystemSpec,
    parse_hdfs_url,
)
from spark_estimators.store.base import Store
from spark_estimators.store.layout import LayoutOverrides, make_layout, parent_of_data_paths


class FilesystemStore(Store):
    """A store on any fsspec filesystem: ``s3://``, ``gs://``, ``abfs://``, ``file://``, ...

    The filesystem is wrapped as a :class:`pyarrow.fs.FileSystem`, so the driver, the executors
    writing prepared Parquet and the readers all use the same client code.

    Parameters
    ----------
    prefix_path
        A URL, e.g. ``"s3://bucket/experiments"``.
    storage_options
        Keyword arguments of the fsspec filesystem, e.g. for S3
        ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``. They are shipped to
        executors as given (and never logged); prefer credentials from the executors' environment
        (instance roles, ``AWS_*`` variables) where you can.
    train_path, val_path, test_path, runs_path, save_runs
        As for :class:`~spark_estimators.store.LocalStore`.

    Examples
    --------
    >>> store = FilesystemStore("s3://bucket/exp", storage_options={"anon": True})
    >>> store.get_run_path("r1")
    's3://bucket/exp/runs/r1'
    """

    def __init__(
        self,
        prefix_path: str,
        *,
        storage_options: Mapping[str, object] | None = None,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
    ) -> None:
        from fsspec.core import split_protocol

        protocol, _ = split_protocol(prefix_path)
        if protocol is None:
            raise ConfigurationError(
                f"FilesystemStore needs a URL with a scheme (e.g. 's3://bucket/prefix'), got "
                f"{prefix_path!r}; use LocalStore for local paths"
            )
        prefix = prefix_path.rstrip("/")
        moved = LayoutOverrides(train_path, val_path, test_path, runs_path)
        for name, value in moved.items():
            if value is not None and split_protocol(value)[0] != protocol:
                raise ConfigurationError(
                    f"{name}={value!r} must be a {protocol}:// URL like the prefix {prefix_path!r}"
                )
        self.storage_options = dict(storage_options or {})
        spec = FsspecFilesystemSpec(protocol, self.storage_options)
        super().__init__(spec, make_layout(prefix, moved, save_runs))


class HDFSStore(Store):
    """A store on HDFS through :class:`pyarrow.fs.HadoopFileSystem` (the old ``pa.hdfs`` is gone).

    ``prefix_path`` may be ``"hdfs://namenode:8020/user/me/exp"``, ``"hdfs:///user/me/exp"`` or
    ``"/user/me/exp"``. ``host``/``port`` arguments win over the URL's; without either the client
    uses ``fs.defaultFS`` from the Hadoop configuration (``host="default"``, ``port=0``).
    Connecting needs libhdfs and the Hadoop jars on ``CLASSPATH`` on the driver and the executors;
    the connection is made lazily, on first use. Without ``prefix_path``, the directory holding
    ``train_path`` and ``val_path`` is the prefix (horovod's docs build
    ``HDFSStore(train_path=..., val_path=...)`` for ``fit_on_parquet``).

    Examples
    --------
    >>> store = HDFSStore("hdfs://nn:8020/user/me/exp")
    >>> store.get_run_path("r1")
    'hdfs://nn:8020/user/me/exp/runs/r1'
    """

    def __init__(
        self,
        prefix_path: str | None = None,
        host: str | None = None,
        port: int | None = None,
        user: str | None = None,
        kerb_ticket: str | None = None,
        extra_conf: Mapping[str, str] | None = None,
        *,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
    ) -> None:
        moved = LayoutOverrides(train_path, val_path, test_path, runs_path)
        if prefix_path is None:
            # horovod's docs build HDFSStore(train_path=..., val_path=...) for fit_on_parquet.
            urls = moved.map(self._url_of)
            prefix_path = parent_of_data_paths("HDFSStore", urls.train_path, urls.val_path)
        parsed = parse_hdfs_url(prefix_path)
        self._url_prefix = parsed.url_prefix
        spec = HadoopFilesystemSpec(
            host=host or parsed.host or "default",
            port=int(port if port is not None else (parsed.port or 0)),
            user=user,
            kerb_ticket=kerb_ticket,
            extra_conf=dict(extra_conf) if extra_conf else None,
        )
        super().__init__(
            spec,
            make_layout(
                self._to_url(parsed.path.rstrip("/") or "/"), moved.map(self._to_url), save_runs
            ),
        )

    @property
    def hdfs_kwargs(self) -> dict[str, str | int | None]:
        """The arguments given to :class:`pyarrow.fs.HadoopFileSystem`."""
        spec = self._spec
        assert isinstance(spec, HadoopFilesystemSpec)
        return {"host": spec.host, "port": spec.port, "user": spec.user}

    @staticmethod
    def _url_of(path: str) -> str:
        parsed = parse_hdfs_url(path)
        return parsed.url_prefix + parsed.path

    def _to_url(self, path: str) -> str:
        if path.startswith("/"):
            return self._url_prefix + path
        parse_hdfs_url(path)  # validates the scheme
        return path

    def full_path(self, path: str) -> str:
        """``path`` as an ``hdfs://`` URL (absolute paths get the store's namenode)."""
        if path.startswith("/"):
            return self._url_prefix + path
        return super().full_path(path)
