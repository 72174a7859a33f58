"""Where a store keeps each kind of artifact, and the path rules every store follows.

The layout (horovod.spark's names) is described in :mod:`spark_estimators.store.base`; this module
holds its names, :class:`StoreLayout`, and the pure path helpers (no filesystem access).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, fields

from spark_estimators.errors import ConfigurationError

TRAIN_DATA_NAME = "intermediate_train_data"
VAL_DATA_NAME = "intermediate_val_data"
TEST_DATA_NAME = "intermediate_test_data"
RUNS_NAME = "runs"
CHECKPOINTS_SUBDIR = "checkpoints"
#: The Keras estimator's checkpoint in a run's checkpoint dir (horovod's was ``checkpoint.h5``;
#: Keras 3 saves whole models only as ``.keras``).
CHECKPOINT_FILENAME = "checkpoint.keras"

LOGS_SUBDIR = "logs"
METADATA_SUFFIX = ".metadata.json"

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


@dataclass(frozen=True)
class StoreLayout:
    """Where each kind of artifact lives (full store paths)."""

    prefix_path: str
    train_path: str
    val_path: str
    test_path: str
    runs_path: str
    save_runs: bool = True


@dataclass(frozen=True)
class FileStat:
    """Size and modification time of one path in a store."""

    path: str
    size: int
    mtime_ns: int | None
    is_dir: bool


def join_path(base: str, *parts: str) -> str:
    """Join store path parts with ``/`` (URLs keep their scheme and authority)."""
    out = base.rstrip("/") if base not in ("/",) else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if not out.endswith("/") else out + part
    return out


def is_absolute_path(path: str) -> bool:
    """True for ``/abs/path`` and for URLs with a scheme (``s3://...``, ``dbfs:/...``)."""
    return path.startswith("/") or bool(_SCHEME_RE.match(path))


def check_name(value: object, what: str) -> str:
    """Validate a run id or dataset index used as one path component."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not text or "/" in text or text in (".", ".."):
        raise ConfigurationError(
            f"{what} {value!r} is not usable as a path component: use a non-empty string "
            "without '/' (e.g. 'run_001')"
        )
    return text


@dataclass(frozen=True)
class LayoutOverrides:
    """The entries a store's constructor may move (``train_path=`` ...); None keeps the default."""

    train_path: str | None = None
    val_path: str | None = None
    test_path: str | None = None
    runs_path: str | None = None

    def items(self) -> list[tuple[str, str | None]]:
        """``(keyword, value)`` of every entry, in the constructors' order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def map(self, convert: Callable[[str], str]) -> LayoutOverrides:
        """The same overrides with ``convert`` applied to each one that is set."""
        return LayoutOverrides(**{k: convert(v) if v else None for k, v in self.items()})


def make_layout(
    prefix_path: str, overrides: LayoutOverrides | None = None, save_runs: bool = True
) -> StoreLayout:
    """The default layout under ``prefix_path``, with the entries of ``overrides`` moved."""
    moved = overrides or LayoutOverrides()
    return StoreLayout(
        prefix_path=prefix_path,
        train_path=moved.train_path or join_path(prefix_path, TRAIN_DATA_NAME),
        val_path=moved.val_path or join_path(prefix_path, VAL_DATA_NAME),
        test_path=moved.test_path or join_path(prefix_path, TEST_DATA_NAME),
        runs_path=moved.runs_path or join_path(prefix_path, RUNS_NAME),
        save_runs=save_runs,
    )


def parent_of_data_paths(store_name: str, train_path: str | None, val_path: str | None) -> str:
    """The directory holding ``train_path`` (and ``val_path``): a store's prefix when none is given.

    >>> parent_of_data_paths("HDFSStore", "hdfs://nn/u/me/train_ds", "hdfs://nn/u/me/val_ds")
    'hdfs://nn/u/me'
    """
    if not train_path:
        raise ConfigurationError(
            f"{store_name} needs a prefix_path (a directory for runs/ and prepared data), or at "
            "least train_path= for data prepared elsewhere"
        )
    heads, parents = set(), []
    for path in filter(None, (train_path, val_path)):
        head, rest = "", path
        if "://" in path:
            scheme, _, after = path.partition("://")
            authority, _, rest = after.partition("/")
            head, rest = f"{scheme}://{authority}", "/" + rest
        heads.add(head)
        parents.append(posixpath.dirname(rest.rstrip("/")) or "/")
    if len(heads) > 1:
        raise ConfigurationError(
            f"{store_name}: train_path {train_path!r} and val_path {val_path!r} are on different "
            "filesystems; give prefix_path= explicitly"
        )
    return heads.pop() + posixpath.commonpath(parents)
