"""The Store: where prepared data, checkpoints and logs live.

Layout under a store's ``prefix_path`` (the names follow horovod.spark so existing data is found)::

    {prefix}/intermediate_train_data.{idx}/part-*.parquet   prepared training data of dataset idx
    {prefix}/intermediate_val_data.{idx}/part-*.parquet     prepared validation data
    {prefix}/intermediate_test_data.{idx}/                  reserved for test data
    {prefix}/intermediate_train_data.{idx}.metadata.json    DatasetMetadata + cache key (written
                                                            last: present means complete)
    {prefix}/runs/{run_id}/checkpoints/                     checkpoints (rank 0 writes them)
    {prefix}/runs/{run_id}/logs/                            TensorBoard and other logs

``train_path`` / ``val_path`` / ``test_path`` / ``runs_path`` override single entries (horovod).

Every store is light: it holds configuration and builds its filesystem client lazily in each
process. :meth:`Store.to_remote` returns a :class:`RemoteStore`, a picklable view with the same
read/write API for Spark executors and rank processes (rank 0 writes checkpoints through it).

Reading and writing (paths, atomic writes, errors) are in :mod:`spark_estimators.store.io`.
"""

from __future__ import annotations

import abc
import logging
import os
import posixpath
import re
from collections.abc import Callable
from typing import Any

from spark_estimators.errors import ConfigurationError, StoreError
from spark_estimators.store._exclusive import write_if_absent
from spark_estimators.store._filesystems import FilesystemSpec
from spark_estimators.store.compat import HorovodStoreMethods
from spark_estimators.store.layout import (  # noqa: F401  (the layout's names, also here)
    CHECKPOINT_FILENAME,
    CHECKPOINTS_SUBDIR,
    LOGS_SUBDIR,
    METADATA_SUFFIX,
    RUNS_NAME,
    TEST_DATA_NAME,
    TRAIN_DATA_NAME,
    VAL_DATA_NAME,
    FileStat,
    StoreLayout,
    check_name,
    is_absolute_path,
    join_path,
    make_layout,
    parent_of_data_paths,
)

logger = logging.getLogger(__name__)


#: What :meth:`Store.create` calls: installed by :mod:`spark_estimators.store.registry`, which the
#: package imports, so the base class need not import the stores built on it.
_store_factory: Callable[..., Store] | None = None


def set_store_factory(factory: Callable[..., Store]) -> None:
    """Install the function behind :meth:`Store.create` (done by the store registry)."""
    global _store_factory
    _store_factory = factory


class StoreBase(HorovodStoreMethods):
    """Layout and I/O shared by :class:`Store` and its remote view :class:`RemoteStore`.

    The I/O is :class:`~spark_estimators.store.io.StoreIO`'s; horovod's names for some of it
    (``get_full_path``, ``get_localized_path``, ``read``, ``is_parquet_dataset``,
    ``get_parquet_dataset``) are :mod:`spark_estimators.store.compat`'s.
    """

    _bound_run_id: str | None = None

    def __init__(self, spec: FilesystemSpec, layout: StoreLayout) -> None:
        super().__init__(spec, layout)
        self._synced: dict[tuple[str, str], tuple[int, int]] = {}

    # ----------------------------------------------------------------- pickling and identity
    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_synced"] = {}
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, StoreBase)
        return (self._spec, self._layout, self._bound_run_id) == (
            other._spec,
            other._layout,
            other._bound_run_id,
        )

    def __hash__(self) -> int:
        return hash((type(self), self._layout, self._bound_run_id))

    # ------------------------------------------------------------------------------ layout
    def write_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; True when this call created it.

        (Defined here, not on :class:`~spark_estimators.store.io.StoreIO`, so that
        ``store/_exclusive.py``, which works on a ``StoreIO``, and ``store/io.py`` do not import
        each other.)

        How exclusive this is depends on the filesystem:

        * local and mounted filesystems (LocalStore, DBFSLocalStore, ``file://``): atomic. The
          data goes to a hidden temp file that is hard-linked to ``path`` (``link`` fails when
          ``path`` exists), so nobody ever sees a partial file; where hard links are refused
          (some FUSE mounts) ``O_CREAT | O_EXCL`` is used, and a reader may briefly see it empty.
        * fsspec stores: ``open(path, "xb")`` where the backend implements exclusive creation
          (s3fs sends ``If-None-Match: *``, which AWS S3 honours).
        * elsewhere (HDFS, backends without ``"xb"``): best effort, a check that ``path`` is absent
          followed by a write; two writers racing in that gap both get True and the last write
          wins. Callers that must know read the content back and compare.
        """
        return write_if_absent(self, path, data)

    def get_train_data_path(self, idx: int | str | None = None) -> str:
        """Directory of the prepared training data of dataset ``idx`` (horovod's naming)."""
        return self._indexed(self._layout.train_path, idx)

    def get_val_data_path(self, idx: int | str | None = None) -> str:
        """Directory of the prepared validation data of dataset ``idx``."""
        return self._indexed(self._layout.val_path, idx)

    def get_test_data_path(self, idx: int | str | None = None) -> str:
        """Directory reserved for test data of dataset ``idx``."""
        return self._indexed(self._layout.test_path, idx)

    def get_dataset_metadata_path(self, idx: int | str | None = None) -> str:
        """The JSON metadata of dataset ``idx``, next to its training data."""
        return self.get_train_data_path(idx) + METADATA_SUFFIX

    def saving_runs(self) -> bool:
        """True when runs (checkpoints, logs) are kept in the store."""
        return self._layout.save_runs

    def get_runs_path(self) -> str:
        """The directory that holds every run."""
        return self._layout.runs_path

    def get_run_path(self, run_id: str | None = None) -> str:
        """The directory of ``run_id`` (default: the bound run)."""
        return join_path(self._layout.runs_path, self._run_id(run_id))

    def get_checkpoint_path(self, run_id: str | None = None) -> str:
        """Directory that holds the checkpoints of a run."""
        return join_path(self.get_run_path(run_id), CHECKPOINTS_SUBDIR)

    def get_checkpoint_filename(self) -> str:
        """The file name of a run's Keras checkpoint in :meth:`get_checkpoint_path` (horovod's).

        ``checkpoint.keras``: horovod named it ``checkpoint.h5``, Keras 3 saves ``.keras``. The
        torch and Lightning estimators keep their checkpoints under other names in the same dir.
        """
        return CHECKPOINT_FILENAME

    def get_logs_path(self, run_id: str | None = None) -> str:
        """Directory that holds the logs (e.g. TensorBoard) of a run."""
        return join_path(self.get_run_path(run_id), LOGS_SUBDIR)

    def _indexed(self, base: str, idx: int | str | None) -> str:
        return base if idx is None else f"{base}.{check_name(idx, 'dataset index')}"

    def _run_id(self, run_id: str | None) -> str:
        run_id = run_id if run_id is not None else self._bound_run_id
        if run_id is None:
            raise ConfigurationError(
                f"{self!r} needs a run_id here: pass run_id=..., or use store.to_remote(run_id)"
            )
        return check_name(run_id, "run_id")

    def sync_dir(self, local_dir: str, run_id: str | None = None, *, subdir: str = "") -> list[str]:
        """Copy new and changed files of ``local_dir`` into ``runs/{run_id}/{subdir}``.

        Files already uploaded by this object and unchanged since (same size and mtime) are skipped,
        so calling it after every epoch costs only what changed.

        Returns
        -------
        list of str
            The store paths written by this call.
        """
        target_root = join_path(self.get_run_path(run_id), subdir)
        local_root = os.path.abspath(local_dir)
        written: list[str] = []
        for dirpath, _dirs, files in os.walk(local_root):
            rel_dir = os.path.relpath(dirpath, local_root)
            for name in sorted(files):
                local_file = os.path.join(dirpath, name)
                target = join_path(target_root, "" if rel_dir == "." else rel_dir, name)
                if os.path.abspath(self.fs_path(target)) == local_file and self._is_local():
                    continue  # already in place (a LocalStore run dir used as the local dir)
                st = os.stat(local_file)
                key = (local_file, target)
                if self._synced.get(key) == (st.st_mtime_ns, st.st_size):
                    continue
                self.upload_file(local_file, target, atomic=True)
                self._synced[key] = (st.st_mtime_ns, st.st_size)
                written.append(target)
        if written:
            logger.debug("synced %d file(s) from %s to %s", len(written), local_root, target_root)
        return written

    # ------------------------------------------------------------------ runs and datasets
    def list_runs(self) -> list[str]:
        """The run ids that have a directory under the runs path."""
        return [name for name in self.listdir(self.get_runs_path()) if not name.startswith(".")]

    def delete_run(self, run_id: str) -> None:
        """Delete ``runs/{run_id}`` with its checkpoints and logs."""
        self.delete(self.get_run_path(check_name(run_id, "run_id")))

    def list_datasets(self) -> list[str]:
        """Indexes of the complete prepared datasets (those whose metadata file exists)."""
        train_base = self._layout.train_path
        parent, base = posixpath.split(train_base.rstrip("/"))
        pattern = re.compile(re.escape(base) + r"\.([^/]+)" + re.escape(METADATA_SUFFIX) + "$")
        found = []
        for name in self.listdir(parent):
            m = pattern.match(name)
            if m:
                found.append(m.group(1))
        return sorted(found)

    def delete_dataset(self, idx: int | str) -> None:
        """Delete a prepared dataset: metadata first (so it is never half-visible), then data."""
        self.delete(self.get_dataset_metadata_path(idx))
        for path in (
            self.get_train_data_path(idx),
            self.get_val_data_path(idx),
            self.get_test_data_path(idx),
        ):
            self.delete(path)


class Store(StoreBase, abc.ABC):
    """Abstract store: build one with :meth:`Store.create` or a concrete class.

    Concrete stores: :class:`~spark_estimators.store.LocalStore`,
    :class:`~spark_estimators.store.FilesystemStore`, :class:`~spark_estimators.store.HDFSStore`,
    :class:`~spark_estimators.store.DBFSLocalStore`.
    """

    @abc.abstractmethod
    def __init__(self, spec: FilesystemSpec, layout: StoreLayout) -> None:
        super().__init__(spec, layout)

    @staticmethod
    def create(prefix_path: str, **kwargs: Any) -> Store:
        """Pick the store class for a URL by its scheme.

        ``file://`` or a plain path -> LocalStore; ``hdfs://`` -> HDFSStore; ``dbfs:/``, and on
        Databricks also ``/dbfs/`` and ``file:///dbfs/`` -> DBFSLocalStore; ``s3://``, ``gs://``,
        ``abfs://`` and other fsspec protocols -> FilesystemStore. Keyword arguments go to the
        class (e.g. ``storage_options=`` for FilesystemStore).

        >>> Store.create("/tmp/experiments")
        LocalStore('/tmp/experiments')
        """
        if _store_factory is None:  # never: importing this module imports the package first
            raise StoreError("spark_estimators.store was not imported; import it first")
        return _store_factory(prefix_path, **kwargs)

    def to_remote(
        self, run_id: str | None = None, dataset_idx: int | str | None = None
    ) -> RemoteStore:
        """A picklable light view for executors and rank processes, bound to a run and dataset."""
        if run_id is not None:
            check_name(run_id, "run_id")
        return RemoteStore(self._spec, self._layout, run_id=run_id, dataset_idx=dataset_idx)


class RemoteStore(StoreBase):
    """What executors and rank processes get: the store's layout and I/O, nothing else.

    ``run_id`` (when bound) is the default of every run-path method, so rank 0 can call
    ``view.write_bytes_atomic(view.get_checkpoint_path() + "/epoch_3.pt", data)``.
    """

    def __init__(
        self,
        spec: FilesystemSpec,
        layout: StoreLayout,
        *,
        run_id: str | None = None,
        dataset_idx: int | str | None = None,
    ) -> None:
        super().__init__(spec, layout)
        self._bound_run_id = run_id
        self.dataset_idx = dataset_idx

    @property
    def run_id(self) -> str | None:
        """The run this view is bound to (the default of every run-path method), or None."""
        return self._bound_run_id

    @property
    def train_data_path(self) -> str:
        """The training data of the bound dataset."""
        return self.get_train_data_path(self.dataset_idx)

    @property
    def val_data_path(self) -> str:
        """The validation data of the bound dataset."""
        return self.get_val_data_path(self.dataset_idx)
