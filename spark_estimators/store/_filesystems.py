"""Picklable recipes for the filesystems behind a Store.

A :class:`FilesystemSpec` holds only plain configuration (a protocol, options, host and port) and
builds the real client with :meth:`FilesystemSpec.create` in whatever process needs it: the driver,
a Spark executor or a rank process. Clients themselves (s3fs sessions, libhdfs handles) never travel
in a pickle. Every spec hands out a :class:`pyarrow.fs.FileSystem`, so stores, Parquet writers and
readers share one API whatever the backend is.

``storage_options`` (endpoints, keys) are shipped with the spec as given, and are kept out of
``repr`` so they never reach a log line.
"""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spark_estimators.errors import ConfigurationError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

# Which pip package provides an fsspec protocol, for the "install X" message.
PIP_PACKAGE_FOR_PROTOCOL: dict[str, tuple[str, str]] = {
    # protocol: (module to import, pip package)
    "s3": ("s3fs", "s3fs"),
    "s3a": ("s3fs", "s3fs"),
    "gs": ("gcsfs", "gcsfs"),
    "gcs": ("gcsfs", "gcsfs"),
    "abfs": ("adlfs", "adlfs"),
    "abfss": ("adlfs", "adlfs"),
    "az": ("adlfs", "adlfs"),
    "adl": ("adlfs", "adlfs"),
}

# Object stores: no real directories, and a single PUT is atomic (nobody sees half an object).
OBJECT_STORE_PROTOCOLS = frozenset(PIP_PACKAGE_FOR_PROTOCOL)

# Options we add to every fsspec filesystem unless the user sets them: listings written by other
# processes (executors) must never be served from a stale per-process cache.
_FSSPEC_DEFAULTS: dict[str, object] = {"skip_instance_cache": True, "use_listings_cache": False}


class FilesystemSpec(abc.ABC):
    """How to build the filesystem of a store, in any process."""

    @property
    def rename_is_atomic(self) -> bool:
        """True when ``move`` replaces the destination atomically (POSIX rename, HDFS rename)."""
        return True

    @property
    def needs_directories(self) -> bool:
        """True when directories must exist before a file is written under them."""
        return True

    @abc.abstractmethod
    def create(self) -> pafs.FileSystem:
        """Build the :class:`pyarrow.fs.FileSystem` (called lazily, once per process and view)."""

    @abc.abstractmethod
    def to_fs_path(self, path: str) -> str:
        """Turn a store path or URL into a path on the filesystem from :meth:`create`."""


@dataclass(frozen=True)
class LocalFilesystemSpec(FilesystemSpec):
    """The local (or NFS/FUSE-mounted) filesystem."""

    def create(self) -> pafs.FileSystem:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(use_mmap=False)

    def to_fs_path(self, path: str) -> str:
        if path.startswith("file://"):
            path = path[len("file://") :]
        elif path.startswith("file:/"):
            path = path[len("file:") :]
        return path


@dataclass(frozen=True)
class FsspecFilesystemSpec(FilesystemSpec):
    """Any fsspec protocol (``s3``, ``gs``, ``abfs``, ...), wrapped for pyarrow.

    Parameters
    ----------
    protocol
        The fsspec protocol, e.g. ``"s3"``.
    storage_options
        Keyword arguments of the fsspec filesystem (e.g. ``key``, ``secret``,
        ``client_kwargs={"endpoint_url": ...}``). Shipped to executors, never shown by ``repr``.
    """

    protocol: str
    storage_options: Mapping[str, object] = field(default_factory=dict, repr=False)

    @property
    def rename_is_atomic(self) -> bool:
        return self.protocol not in OBJECT_STORE_PROTOCOLS

    @property
    def needs_directories(self) -> bool:
        return self.protocol not in OBJECT_STORE_PROTOCOLS

    def __post_init__(self) -> None:
        check_protocol_installed(self.protocol)

    def create(self) -> pafs.FileSystem:
        import fsspec
        import pyarrow.fs as pafs

        options = {**_FSSPEC_DEFAULTS, **dict(self.storage_options)}
        fs = fsspec.filesystem(self.protocol, **options)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs))

    def to_fs_path(self, path: str) -> str:
        from fsspec.core import split_protocol

        protocol, rest = split_protocol(path)
        if protocol is None and path.startswith("/"):
            raise ConfigurationError(
                f"path {path!r} has no {self.protocol}:// scheme; pass a full "
                f"{self.protocol}:// URL or a path relative to the store prefix"
            )
        return rest.rstrip("/") if rest != "/" else rest


@dataclass(frozen=True)
class HadoopFilesystemSpec(FilesystemSpec):
    """HDFS via :class:`pyarrow.fs.HadoopFileSystem` (needs libhdfs and the Hadoop CLASSPATH)."""

    host: str = "default"
    port: int = 0
    user: str | None = None
    kerb_ticket: str | None = None
    extra_conf: Mapping[str, str] | None = field(default=None, repr=False)

    def create(self) -> pafs.FileSystem:
        import pyarrow.fs as pafs

        try:
            return pafs.HadoopFileSystem(
                self.host,
                self.port,
                user=self.user,
                kerb_ticket=self.kerb_ticket,
                extra_conf=dict(self.extra_conf) if self.extra_conf else None,
            )
        except OSError as exc:
            raise ConfigurationError(
                f"cannot connect to HDFS at host={self.host!r} port={self.port!r}: {exc}. "
                "pyarrow needs libhdfs (set ARROW_LIBHDFS_DIR or HADOOP_HOME) and the Hadoop jars "
                "on CLASSPATH (export CLASSPATH=$(hadoop classpath --glob)) on the driver and on "
                "every executor"
            ) from exc

    def to_fs_path(self, path: str) -> str:
        return parse_hdfs_url(path).path


@dataclass(frozen=True)
class HdfsUrl:
    """The parts of an HDFS URL: ``hdfs://host:port/path``."""

    host: str | None
    port: int | None
    path: str
    url_prefix: str  # what goes before ``path`` in full URLs, e.g. "hdfs://nn:8020" or "hdfs://"


def parse_hdfs_url(url: str) -> HdfsUrl:
    """Split ``hdfs://host:port/path``, ``hdfs:///path`` or ``/path`` into its parts.

    >>> parse_hdfs_url("hdfs://namenode:8020/user/me/exp")
    HdfsUrl(host='namenode', port=8020, path='/user/me/exp', url_prefix='hdfs://namenode:8020')
    >>> parse_hdfs_url("/user/me/exp").host is None
    True
    """
    if url.startswith("/"):
        return HdfsUrl(None, None, url, "hdfs://")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "hdfs":
        raise ConfigurationError(
            f"{url!r} is not an HDFS URL; use 'hdfs://host:port/path', 'hdfs:///path' or '/path'"
        )
    authority, slash, path = rest.partition("/")
    if not slash or not path.strip("/"):
        raise ConfigurationError(
            f"HDFS URL {url!r} has no path; use e.g. 'hdfs://namenode:8020/user/me/experiments'"
        )
    host: str | None = None
    port: int | None = None
    if authority:
        host, colon, port_text = authority.partition(":")
        if colon:
            if not port_text.isdigit():
                raise ConfigurationError(
                    f"HDFS URL {url!r} has a bad port {port_text!r}; use 'hdfs://host:8020/path'"
                )
            port = int(port_text)
        host = host or None
    return HdfsUrl(host, port, "/" + path, f"hdfs://{authority}")


def check_protocol_installed(protocol: str) -> None:
    """Raise :class:`ConfigurationError` naming the pip package a protocol needs and lacks."""
    known = PIP_PACKAGE_FOR_PROTOCOL.get(protocol)
    if known is not None:
        module, package = known
        if importlib.util.find_spec(module) is None:
            raise ConfigurationError(
                f"the {protocol}:// store needs the {package!r} package, which is not installed: "
                f"pip install {package}"
            )
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError as exc:
        raise ConfigurationError(
            f"unknown filesystem protocol {protocol!r}; use one of 'file', 's3', 'gs', 'abfs', "
            f"'hdfs', 'dbfs' or another protocol fsspec knows ({exc})"
        ) from exc
    except ImportError as exc:
        raise ConfigurationError(
            f"the {protocol}:// store needs an optional package: {exc}"
        ) from exc
