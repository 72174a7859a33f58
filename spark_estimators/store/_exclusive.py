"""``StoreIO.write_if_absent``: create a file only if it does not exist (see its docstring)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from typing import TYPE_CHECKING

from spark_estimators.errors import StoreError

if TYPE_CHECKING:
    from spark_estimators.store.io import StoreIO


def write_if_absent(store: StoreIO, path: str, data: bytes) -> bool:
    """True when this call created ``path`` holding ``data``; False when it existed."""
    target = store.fs_path(path)
    store._ensure_parent(target, path)
    if store._is_local():
        return _local_create_exclusive(target, data)
    handler = getattr(store.filesystem, "handler", None)  # pyarrow's wrapper of an fsspec fs
    fsspec_fs = getattr(handler, "fs", None)
    if fsspec_fs is not None:
        try:
            with store._io_errors("write", path), fsspec_fs.open(target, "xb") as out:
                out.write(data)
            return True
        except StoreError as exc:
            if isinstance(exc.__cause__, FileExistsError):
                return False
            raise
        except (ValueError, NotImplementedError, TypeError):
            pass  # this backend has no "xb" mode: fall back to check-then-write
    if store.exists(path):
        return False
    store.write_bytes(path, data, atomic=True)
    return True


def _local_create_exclusive(target: str, data: bytes) -> bool:
    """``write_if_absent`` on a local path: write a temp file, then hard-link it into place."""
    tmp = posixpath.join(
        posixpath.dirname(target), f".{posixpath.basename(target)}.tmp-{uuid.uuid4().hex[:12]}"
    )
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # no hard links here (some FUSE mounts): O_EXCL below
    except OSError as exc:
        raise StoreError(f"cannot write {target!r}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise StoreError(f"cannot create {target!r}: {exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True
