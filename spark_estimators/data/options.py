"""The reader's settings as one value: :class:`ReaderOptions`.

Estimators build one ``ReaderOptions`` per split on the driver and ship it to the ranks, instead of
threading a dozen keywords through every call. :func:`~spark_estimators.data.make_batch_reader`
takes it as ``options=``; keywords passed next to it override its fields (the same as
``options.replace(...)``), so the old keyword calls keep working unchanged.

Which split, rank and size a reader serves are not options: they differ per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard

from spark_estimators.errors import ConfigurationError

TransformFn = Callable[[Any], Any]

READERS = ("arrow", "petastorm")


@dataclass(frozen=True)
class ReaderOptions:
    """How a rank reads its shard: batching, columns, shuffling, caching and the pipeline.

    Parameters
    ----------
    batch_size
        Rows per batch; every batch is full.
    columns
        Columns to read (default: features, labels, sample weight).
    shuffle, seed, epoch
        Seeded shuffle (``seed=None`` means 0) of row groups and inside ``shuffle_buffer_size``
        rows; ``epoch`` is the first epoch's number.
    shuffle_buffer_size
        Rows permuted together; ``None`` or 0: ``min(shard rows, max(min(100000, 256 MB of
        rows), 4 * batch_size))``.
    inmemory_cache
        Keep this rank's decoded shard in memory after the first epoch.
    transformation_fn
        ``fn(pandas.DataFrame) -> pandas.DataFrame`` applied to each decoded row group.
    stack_columns
        ``{"x": ["f0", "f1", ...]}`` stacks scalar columns into one ``[batch, k]`` array.
    prefetch, num_workers
        Groups of batches cut ahead by the background thread (0 = no thread), and row-group
        slices decoded at once on their own threads (Arrow decodes without the GIL).
    reader
        ``"arrow"`` (ours) or ``"petastorm"``.
    pool_type, transform_edit_fields, transform_removed_fields
        petastorm only (horovod's ``reader_pool_type``, ``transformation_edit_fields``,
        ``transformation_removed_fields``): petastorm's worker pool (``"thread"``, ``"process"``,
        ``"dummy"``) and the ``TransformSpec`` schema changes of ``transformation_fn``. The default
        reader decodes on its own threads and lets ``transformation_fn`` add or drop columns
        freely, so it takes only ``pool_type="thread"`` and no fields.

    Examples
    --------
    >>> opts = ReaderOptions(batch_size=64, shuffle=False)
    >>> opts.replace(batch_size=128).batch_size
    128
    """

    batch_size: int = 32
    columns: tuple[str, ...] | None = None
    shuffle: bool = True
    seed: int | None = 0
    epoch: int = 0
    shuffle_buffer_size: int | None = None
    inmemory_cache: bool = False
    transformation_fn: TransformFn | None = None
    stack_columns: Mapping[str, Sequence[str]] | None = None
    prefetch: int = 2
    num_workers: int = 2
    reader: str = "arrow"
    pool_type: str = "thread"
    transform_edit_fields: tuple[object, ...] | None = None
    transform_removed_fields: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.columns is not None:
            if isinstance(self.columns, str):
                raise ConfigurationError(
                    f"columns={self.columns!r} must be a sequence of column names, not a string"
                )
            object.__setattr__(self, "columns", tuple(self.columns))
        if self.stack_columns is not None:
            object.__setattr__(
                self, "stack_columns", {k: tuple(v) for k, v in self.stack_columns.items()}
            )
        if not _positive_int(self.batch_size):
            raise ConfigurationError(f"batch_size={self.batch_size!r} must be a positive integer")
        if not _positive_int(self.num_workers) or not _non_negative_int(self.prefetch):
            raise ConfigurationError(
                f"num_workers={self.num_workers!r} must be >= 1 and prefetch={self.prefetch!r} >= 0"
            )
        if self.shuffle_buffer_size is not None and not _non_negative_int(self.shuffle_buffer_size):
            raise ConfigurationError(
                f"shuffle_buffer_size={self.shuffle_buffer_size!r} must be a positive integer "
                "or None (0 and None mean the default size)"
            )
        if self.reader not in READERS:
            raise ConfigurationError(f"reader={self.reader!r} is not one of {READERS!r}")
        for name in ("transform_edit_fields", "transform_removed_fields"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.reader == "arrow":
            check_arrow_reader_settings(
                self.pool_type, self.transform_edit_fields, self.transform_removed_fields
            )

    def replace(self, **changes: Any) -> ReaderOptions:
        """A copy with ``changes``; an unknown name is a :class:`ConfigurationError`."""
        unknown = sorted(set(changes) - set(OPTION_NAMES))
        if unknown:
            raise ConfigurationError(
                f"unknown reader option(s) {unknown!r}; valid: {list(OPTION_NAMES)!r}"
            )
        return dataclasses.replace(self, **changes)

    def reader_kwargs(self) -> dict[str, Any]:
        """The fields as keywords of the reader class that ``reader`` names."""
        out = {f: getattr(self, f) for f in OPTION_NAMES}
        del out["reader"]
        if self.reader == "arrow":
            for name in PETASTORM_ONLY:
                del out[name]
        return out


PETASTORM_ONLY = ("pool_type", "transform_edit_fields", "transform_removed_fields")


def check_arrow_reader_settings(
    pool_type: str | None,
    edit_fields: Sequence[object] | None,
    removed_fields: Sequence[str] | None,
) -> None:
    """Refuse petastorm-only reader options with the default reader, naming the alternative."""
    if pool_type not in ("thread", None):
        raise ConfigurationError(
            f"pool_type={pool_type!r} (horovod's reader_pool_type) needs reader='petastorm'; the "
            "default reader decodes on its own threads: set num_workers "
            "(train_reader_num_workers) for its parallelism, or pass reader='petastorm'"
        )
    for name, value in (("edit_fields", edit_fields), ("removed_fields", removed_fields)):
        if value:
            raise ConfigurationError(
                f"transform_{name}={value!r} (horovod's transformation_{name}) needs "
                "reader='petastorm' (a petastorm TransformSpec schema); with the default reader "
                "transformation_fn may add, change or drop columns freely: remove it, or pass "
                "reader='petastorm'"
            )


class ReaderKeywords(TypedDict, total=False):
    """The fields of :class:`ReaderOptions` as keywords of ``make_batch_reader`` (for typing)."""

    batch_size: int
    columns: Sequence[str] | None
    shuffle: bool
    seed: int | None
    epoch: int
    shuffle_buffer_size: int | None
    inmemory_cache: bool
    transformation_fn: TransformFn | None
    stack_columns: Mapping[str, Sequence[str]] | None
    prefetch: int
    num_workers: int
    reader: str
    pool_type: str
    transform_edit_fields: Sequence[object] | None
    transform_removed_fields: Sequence[str] | None


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ReaderOptions))


def _positive_int(value: object) -> TypeGuard[int]:
    return _non_negative_int(value) and value >= 1


def _non_negative_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
