"""How a prepared dataset is cut into ranks' shards: row ranges, row-group slices, steps.

Shared by the default reader (``data/reader.py``) and the petastorm reader, so every reader gives
each rank the same rows and the same number of steps per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spark_estimators import envvars
from spark_estimators.data.metadata import ParquetFileInfo
from spark_estimators.errors import ConfigurationError

__all__ = ["RowSlice", "plan_shard", "rank_and_size", "shard_bounds", "steps_per_epoch"]


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, stop)`` of one row group of one file."""

    path: str
    row_group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Number of rows in the slice."""
        return self.stop - self.start


def shard_bounds(total_rows: int, rank: int, size: int) -> tuple[int, int]:
    """The global row range ``[lo, hi)`` of ``rank`` (lengths differ by at most one)."""
    return rank * total_rows // size, (rank + 1) * total_rows // size


def plan_shard(files: Sequence[ParquetFileInfo], rank: int, size: int) -> list[RowSlice]:
    """The row-group slices that make up the shard of ``rank``."""
    total = sum(f.rows for f in files)
    lo, hi = shard_bounds(total, rank, size)
    out = []
    offset = 0
    for f in files:
        for group, rows in enumerate(f.row_groups):
            start, stop = max(lo, offset), min(hi, offset + rows)
            if start < stop:
                out.append(RowSlice(f.path, group, start - offset, stop - offset))
            offset += rows
            if offset >= hi:
                return out
    return out


def steps_per_epoch(total_rows: int, size: int, batch_size: int) -> int:
    """Batches every rank yields per epoch: ``ceil(largest shard / batch_size)``."""
    largest_shard = -(-total_rows // size)
    return -(-largest_shard // batch_size)


def rank_and_size(rank: int | None, size: int | None) -> tuple[int, int]:
    """``rank``/``size``, each from the rank's environment when None; checked."""
    if rank is None:
        rank = envvars.env_int(envvars.SE_RANK, 0)
    if size is None:
        size = envvars.env_int(envvars.SE_SIZE, 1)
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise ConfigurationError(f"rank={rank!r}, size={size!r}: need 0 <= rank < size")
    return rank, size
