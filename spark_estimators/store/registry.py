"""``Store.create(url)``: pick the store class from a URL's scheme (and the Databricks rules).

This module sits above the stores it picks from and installs :func:`create_store` as the factory
of :meth:`spark_estimators.store.Store.create` when imported (``spark_estimators.store`` imports
it), so ``store.base`` never imports the classes built on it.
"""

from __future__ import annotations

import re
from typing import Any

from spark_estimators.errors import ConfigurationError
from spark_estimators.store._filesystems import check_protocol_installed
from spark_estimators.store.base import Store, set_store_factory
from spark_estimators.store.filesystem import FilesystemStore, HDFSStore
from spark_estimators.store.local import DBFSLocalStore, LocalStore, is_databricks, is_dbfs_path

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")

#: Schemes with a dedicated class; anything else fsspec knows goes to FilesystemStore.
KNOWN_SCHEMES = ("file", "hdfs", "dbfs", "s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")


def url_scheme(url: str) -> str:
    """The lower-case scheme of ``url`` ('' for a plain path)."""
    m = _SCHEME_RE.match(url)
    return m.group(1).lower() if m else ""


def create_store(prefix_path: str, **kwargs: Any) -> Store:
    """See :meth:`spark_estimators.store.Store.create`."""
    if not isinstance(prefix_path, str) or not prefix_path:
        raise ConfigurationError(
            f"store prefix {prefix_path!r} must be a non-empty path or URL, e.g. '/tmp/exp' or "
            "'s3://bucket/exp'"
        )
    scheme = url_scheme(prefix_path)
    options = kwargs.pop("storage_options", None)
    if options and (scheme in ("", "file", "hdfs", "dbfs") or is_dbfs_path(prefix_path)):
        raise ConfigurationError(
            f"storage_options only apply to fsspec stores (s3://, gs://, abfs://, ...), not to "
            f"{prefix_path!r}; leave them out"
        )
    # Databricks rules: dbfs:/ always means the FUSE mount; /dbfs/ and file:///dbfs/ only on
    # Databricks (elsewhere they are ordinary local paths).
    if scheme == "dbfs":
        if prefix_path.startswith("dbfs://"):
            raise ConfigurationError(
                f"{prefix_path!r}: use 'dbfs:/path' (one slash), which maps to the /dbfs mount"
            )
        return DBFSLocalStore(prefix_path, **kwargs)
    if is_dbfs_path(prefix_path) and is_databricks():
        return DBFSLocalStore(prefix_path, **kwargs)
    if scheme in ("", "file"):
        return LocalStore(prefix_path, **kwargs)
    if scheme == "hdfs":
        return HDFSStore(prefix_path, **kwargs)
    try:
        check_protocol_installed(scheme)
    except ConfigurationError as exc:
        if "unknown filesystem protocol" in str(exc):
            raise ConfigurationError(
                f"unknown store scheme {scheme!r} in {prefix_path!r}; use one of "
                f"{', '.join(repr(s) for s in KNOWN_SCHEMES)} (or a plain local path)"
            ) from exc
        raise
    return FilesystemStore(prefix_path, storage_options=options, **kwargs)


set_store_factory(create_store)
