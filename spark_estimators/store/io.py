"""Reading, writing and deleting a store's files: :class:`StoreIO`, the base of every store.

Paths given to the I/O methods may be full store paths (as returned by the ``get_*_path``
methods of :class:`~spark_estimators.store.base.StoreBase`: an absolute local path,
``s3://bucket/key``, ``hdfs://nn:8020/path``) or paths relative to the prefix. Errors of the
filesystem are raised as :class:`~spark_estimators.errors.StoreError`, naming the path.

Atomic writes (``atomic=True``, :meth:`StoreIO.write_bytes_atomic`, :meth:`StoreIO.open_write`):
on filesystems with an atomic rename (local, DBFS FUSE, HDFS) the data goes to a hidden temp name in
the same directory and is renamed over the target; on object stores (S3, GCS, Azure) the data is
buffered and sent in one PUT, which an object store applies whole or not at all. Either way a crash
or an exception in the ``with`` body never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from spark_estimators.errors import StoreError
from spark_estimators.store._filesystems import FilesystemSpec
from spark_estimators.store.layout import FileStat, StoreLayout, is_absolute_path, join_path

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_SPOOL_BYTES = 64 << 20
_COPY_CHUNK = 8 << 20
_READ_ATTEMPTS = 3


class StoreIO:
    """The filesystem half of a store: paths under its prefix, reading, writing, deleting."""

    def __init__(self, spec: FilesystemSpec, layout: StoreLayout) -> None:
        self._spec = spec
        self._layout = layout
        self._fs: pafs.FileSystem | None = None

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_fs"] = None  # clients are rebuilt in the receiving process
        return state

    @property
    def prefix_path(self) -> str:
        """The store's root path or URL, as given."""
        return self._layout.prefix_path

    @property
    def filesystem_spec(self) -> FilesystemSpec:
        """The picklable recipe of this store's filesystem."""
        return self._spec

    # ------------------------------------------------------------------------------- paths
    def full_path(self, path: str) -> str:
        """The full store path of ``path`` (relative paths are taken under the prefix)."""
        return path if is_absolute_path(path) else join_path(self.prefix_path, path)

    def fs_path(self, path: str) -> str:
        """The path of ``path`` on :attr:`filesystem` (what pyarrow and fsspec calls take)."""
        return self._spec.to_fs_path(self.full_path(path))

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The :class:`pyarrow.fs.FileSystem` of this store, built once per process."""
        if self._fs is None:
            self._fs = self._spec.create()
        return self._fs

    # ----------------------------------------------------------------------------- queries
    def exists(self, path: str) -> bool:
        """True when ``path`` exists (file or directory)."""
        import pyarrow.fs as pafs

        return self._info(path).type != pafs.FileType.NotFound

    def isdir(self, path: str) -> bool:
        """True when ``path`` is a directory."""
        import pyarrow.fs as pafs

        return self._info(path).type == pafs.FileType.Directory

    def stat(self, path: str) -> FileStat:
        """Size and modification time of a file (or a directory)."""
        import pyarrow.fs as pafs

        info = self._info(path)
        if info.type == pafs.FileType.NotFound:
            raise StoreError(f"{path!r} does not exist in {self!r}")
        return FileStat(
            path=self.full_path(path),
            size=int(info.size or 0),
            mtime_ns=info.mtime_ns,
            is_dir=info.type == pafs.FileType.Directory,
        )

    def listdir(self, path: str = "") -> list[str]:
        """Sorted names of the entries directly under ``path`` (``[]`` when it does not exist)."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.fs_path(path), allow_not_found=True, recursive=False)
        with self._io_errors("list", path):
            infos = self.filesystem.get_file_info(selector)
        return sorted(info.base_name for info in infos)

    def _info(self, path: str) -> pafs.FileInfo:
        with self._io_errors("stat", path):
            return self.filesystem.get_file_info(self.fs_path(path))

    # ----------------------------------------------------------------------------- reading
    def read_bytes(self, path: str) -> bytes:
        """The whole content of the file at ``path``.

        A file replaced while it is read (an object store checks the version it opened: s3fs
        raises ``FileExpired`` when a run lock's heartbeat rewrote it between the open and the
        GET) is read again, up to ``_READ_ATTEMPTS`` times in all; a missing file is not.
        """
        attempt = 1
        while True:
            try:
                with self.filesystem.open_input_stream(self.fs_path(path)) as src:
                    return bytes(src.read())
            except FileNotFoundError as exc:
                raise StoreError(f"cannot read {path!r} in {self!r}: it does not exist") from exc
            except OSError as exc:
                if attempt >= _READ_ATTEMPTS or not self.exists(path):
                    raise StoreError(f"cannot read {path!r} in {self!r}: {exc}") from exc
            attempt += 1

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The content of the file at ``path``, decoded."""
        return self.read_bytes(path).decode(encoding)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[IO[bytes]]:
        """A seekable binary file for ``path`` (``torch.load(f)`` works on it)."""
        with (
            self._io_errors("read", path),
            self.filesystem.open_input_file(self.fs_path(path)) as src,
        ):
            yield src

    def download_file(self, path: str, local_path: str) -> None:
        """Copy one store file to the local disk."""
        with self.open_read(path) as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)

    # ----------------------------------------------------------------------------- writing
    @contextlib.contextmanager
    def open_write(self, path: str, *, atomic: bool = False) -> Iterator[IO[bytes]]:
        """A binary file that writes ``path``; parents are created as needed.

        With ``atomic=True`` the target holds either its old content or the complete new one,
        never a part, even when the ``with`` body raises (see the module docstring).
        """
        self._check_fence(path)
        target = self.fs_path(path)
        fs = self.filesystem
        self._ensure_parent(target, path)
        if not atomic:
            with self._io_errors("write", path), fs.open_output_stream(target) as out:
                yield out
            return
        if self._spec.rename_is_atomic:
            tmp = posixpath.join(
                posixpath.dirname(target),
                f".{posixpath.basename(target)}.tmp-{uuid.uuid4().hex[:12]}",
            )
            try:
                with self._io_errors("write", path):
                    with fs.open_output_stream(tmp) as out:
                        yield out
                    _replace(fs, tmp, target)
            except BaseException:
                _delete_quietly(fs, tmp)
                raise
        else:
            with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as buf:
                yield buf  # type: ignore[misc]
                buf.seek(0)
                with self._io_errors("write", path), fs.open_output_stream(target) as out:
                    shutil.copyfileobj(buf, out, _COPY_CHUNK)

    def write_bytes(self, path: str, data: bytes, *, atomic: bool = False) -> None:
        """Write ``data`` to ``path``; ``atomic=True``: readers see the old or the new file only."""
        with self.open_write(path, atomic=atomic) as out:
            out.write(data)

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` so that ``path`` never holds a partial file (see :meth:`open_write`)."""
        self.write_bytes(path, data, atomic=True)

    def write_text(
        self, path: str, text: str, *, atomic: bool = False, encoding: str = "utf-8"
    ) -> None:
        """Write ``text`` to ``path``, encoded; ``atomic`` as in :meth:`write_bytes`."""
        self.write_bytes(path, text.encode(encoding), atomic=atomic)

    def upload_file(self, local_path: str, path: str, *, atomic: bool = False) -> None:
        """Copy one local file into the store."""
        with open(local_path, "rb") as src, self.open_write(path, atomic=atomic) as out:
            shutil.copyfileobj(src, out, _COPY_CHUNK)

    def check_writable(self) -> None:
        """Write and delete a small probe file at the store's root, or raise StoreError.

        Estimators call it in the driver before any data is written, so an unwritable store is
        reported in milliseconds, naming the path, instead of as a failed executor task.
        """
        probe = f".se-write-probe-{uuid.uuid4().hex[:12]}"
        try:
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except StoreError as exc:
            raise StoreError(
                f"the store at {self.prefix_path!r} is not writable from the driver ({exc}); "
                "give a store path this user can create and write (executors need the same)"
            ) from exc

    def makedirs(self, path: str) -> None:
        """Create a directory and its parents (a no-op on object stores)."""
        if self._spec.needs_directories:
            with self._io_errors("create directory", path):
                self.filesystem.create_dir(self.fs_path(path), recursive=True)

    def delete(self, path: str) -> None:
        """Delete a file, or a directory with everything under it; missing paths are ignored."""
        import pyarrow.fs as pafs

        self._check_fence(path)
        info = self._info(path)
        with self._io_errors("delete", path):
            if info.type == pafs.FileType.Directory:
                self.filesystem.delete_dir(info.path)
            elif info.type != pafs.FileType.NotFound:
                self.filesystem.delete_file(info.path)

    # ------------------------------------------------------------------------------ helpers
    def _check_fence(self, path: str) -> None:
        """Refuse to write a run this store's fit no longer owns (see ``store/lock.py``)."""
        fence = self.__dict__.get("_write_fence")
        if fence is not None:
            fence(self, path)

    def _is_local(self) -> bool:
        from spark_estimators.store._filesystems import LocalFilesystemSpec

        return isinstance(self._spec, LocalFilesystemSpec)

    def _ensure_parent(self, fs_target: str, path: str) -> None:
        if self._spec.needs_directories:
            parent = posixpath.dirname(fs_target)
            if parent:
                with self._io_errors("create directory", path):
                    self.filesystem.create_dir(parent, recursive=True)

    @contextlib.contextmanager
    def _io_errors(self, op: str, path: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except FileNotFoundError as exc:
            raise StoreError(f"cannot {op} {path!r} in {self!r}: it does not exist") from exc
        except OSError as exc:
            raise StoreError(f"cannot {op} {path!r} in {self!r}: {exc}") from exc


def _replace(fs: pafs.FileSystem, src: str, dst: str) -> None:
    """Rename ``src`` over ``dst`` (HDFS refuses to rename onto an existing file: delete first)."""
    try:
        fs.move(src, dst)
    except OSError:
        import pyarrow.fs as pafs

        if fs.get_file_info(dst).type != pafs.FileType.File:
            raise
        fs.delete_file(dst)
        fs.move(src, dst)


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(OSError):
        fs.delete_file(path)
