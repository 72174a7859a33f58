"""Stores on a local (or network-mounted) filesystem: LocalStore and DBFSLocalStore."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from spark_estimators.errors import ConfigurationError
from spark_estimators.store._filesystems import LocalFilesystemSpec
from spark_estimators.store.base import Store
from spark_estimators.store.filesystem import FilesystemStore
from spark_estimators.store.layout import LayoutOverrides, make_layout, parent_of_data_paths

#: Where Databricks mounts DBFS on every node. Tests point it at a temp dir; the mapping is done
#: on the driver when the store is built, so executors need no such setting.
DBFS_FUSE_ROOT = "/dbfs"


def _local_prefix(prefix_path: str) -> str:
    path = LocalFilesystemSpec().to_fs_path(prefix_path)
    if "://" in path:
        raise ConfigurationError(
            f"LocalStore takes a local path or a file:// URL, got {prefix_path!r}; use "
            "Store.create(url) to pick the store for other schemes"
        )
    return os.path.abspath(os.path.expanduser(path))


class LocalStore(FilesystemStore):
    """A store on the local filesystem, or any filesystem mounted on every node (NFS, FUSE).

    A :class:`~spark_estimators.store.FilesystemStore` (as in horovod, where LocalStore is one),
    but read and written through pyarrow's local filesystem directly, not through fsspec.

    Parameters
    ----------
    prefix_path
        A local directory (or ``file://`` URL). With more than one machine it must be a shared
        mount, since executors write the prepared data and the driver reads it. May be left out
        when ``train_path`` is given (horovod's docs build ``HDFSStore(train_path=...,
        val_path=...)`` for ``fit_on_parquet``): it is then the directory that holds the train
        and validation paths, and ``runs/`` goes there.
    train_path, val_path, test_path, runs_path
        Override one entry of the layout (see :mod:`spark_estimators.store.base`).
    save_runs
        Keep ``runs/`` (checkpoints, logs) after training.

    Examples
    --------
    >>> store = LocalStore("/tmp/experiments")
    >>> store.get_logs_path("run_1")
    '/tmp/experiments/runs/run_1/logs'
    """

    def __init__(
        self,
        prefix_path: str | None = None,
        *,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
    ) -> None:
        moved = LayoutOverrides(train_path, val_path, test_path, runs_path).map(_local_prefix)
        if prefix_path is None:
            prefix_path = parent_of_data_paths(
                type(self).__name__, moved.train_path, moved.val_path
            )
        layout = make_layout(_local_prefix(prefix_path), moved, save_runs)
        self.storage_options: dict[str, object] = {}
        # Store's constructor, not FilesystemStore's: no fsspec protocol and options to resolve.
        Store.__init__(self, LocalFilesystemSpec(), layout)

    def get_full_path(self, path: str) -> str:
        """``path`` as a ``file://`` URL (relative paths are under the prefix).

        >>> LocalStore("/tmp/experiments").get_full_path("runs")
        'file:///tmp/experiments/runs'
        """
        return pathlib.PurePosixPath(self.fs_path(path)).as_uri()


def session_local_store(prefix: str = "spark_estimators-store-") -> LocalStore:
    """A LocalStore in a new temp dir that is removed when this Python process exits.

    The store of a fit given no ``store=``: the user chose no place to keep prepared data,
    checkpoints and logs, so they are scratch of this session. The fitted model holds its weights
    in memory, and a refit with the same ``run_id`` in the same session still resumes from the
    checkpoint; pass ``store=`` to keep them longer (or to share them between machines).
    """
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return LocalStore(path)


def is_databricks() -> bool:
    """True inside a Databricks runtime (it sets ``DATABRICKS_RUNTIME_VERSION``)."""
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


def is_dbfs_path(path: str) -> bool:
    """``dbfs:/x``, ``/dbfs/x``, ``file:///dbfs/x`` or ``file:/dbfs/x``."""
    return (
        (path.startswith("dbfs:/") and not path.startswith("dbfs://"))
        or path.startswith("/dbfs/")
        or path == "/dbfs"
        or path.startswith("file:///dbfs/")
        or path.startswith("file:/dbfs/")
    )


def dbfs_local_path(path: str, fuse_root: str | None = None) -> str:
    """Map a DBFS path in any of its forms to the FUSE path (``/dbfs/x`` on Databricks).

    >>> dbfs_local_path("dbfs:/ml/exp")
    '/dbfs/ml/exp'
    """
    if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
        rest = path[len("dbfs:") :]
    elif path.startswith("file:///dbfs"):
        rest = path[len("file:///dbfs") :]
    elif path.startswith("file:/dbfs"):
        rest = path[len("file:/dbfs") :]
    elif path == "/dbfs" or path.startswith("/dbfs/"):
        rest = path[len("/dbfs") :]
    else:
        raise ConfigurationError(
            f"{path!r} is not a DBFS path; use 'dbfs:/...', '/dbfs/...' or 'file:///dbfs/...'"
        )
    root = DBFS_FUSE_ROOT if fuse_root is None else fuse_root
    return root.rstrip("/") + "/" + rest.lstrip("/")


@dataclass(frozen=True)
class DbfsFilesystemSpec(LocalFilesystemSpec):
    """The local filesystem, with DBFS paths (``dbfs:/x`` ...) mapped to the FUSE mount."""

    fuse_root: str = "/dbfs"

    def to_fs_path(self, path: str) -> str:
        """``dbfs:/`` paths as their FUSE mount path; other paths as for a local store."""
        if is_dbfs_path(path):
            return dbfs_local_path(path, self.fuse_root)
        return super().to_fs_path(path)


class DBFSLocalStore(LocalStore):
    """Databricks File System through its local FUSE mount (``/dbfs``), on driver and workers.

    Accepts ``dbfs:/x``, ``/dbfs/x``, ``file:///dbfs/x`` and ``file:/dbfs/x``; all map to
    ``/dbfs/x``. Paths given to the I/O methods may use any of these forms too.
    ``get_full_path`` gives ``file:///dbfs/x`` and ``get_localized_path`` ``/dbfs/x`` (horovod's).
    """

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        """True for a DBFS path in any of its forms (horovod's name; ``dbfs://x`` is not one).

        >>> DBFSLocalStore.matches_dbfs("dbfs:/tmp/a"), DBFSLocalStore.matches_dbfs("dbfs://tmp")
        (True, False)
        """
        return is_dbfs_path(path)

    @staticmethod
    def normalize_path(path: str) -> str:
        """A DBFS path in the form ``/dbfs/...``; ConfigurationError (a ValueError) otherwise.

        >>> DBFSLocalStore.normalize_path("file:///dbfs/tmp/a1")
        '/dbfs/tmp/a1'
        """
        return dbfs_local_path(path, fuse_root="/dbfs")

    def __init__(self, prefix_path: str, **kwargs: Any) -> None:
        if not is_dbfs_path(prefix_path):
            raise ConfigurationError(
                f"{prefix_path!r} is not a DBFS path; use 'dbfs:/...', '/dbfs/...' or "
                "'file:///dbfs/...'"
            )
        self.dbfs_path = prefix_path
        mapped: dict[str, Any] = {
            k: dbfs_local_path(v) if isinstance(v, str) and is_dbfs_path(v) else v
            for k, v in kwargs.items()
        }
        super().__init__(dbfs_local_path(prefix_path), **mapped)
        # The FUSE root is fixed now, on the driver, and travels inside the spec.
        self._spec = DbfsFilesystemSpec(fuse_root=DBFS_FUSE_ROOT)
