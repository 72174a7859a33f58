"""Executor side of prepare_data: write one Spark partition as Parquet through the store filesystem.

Runs inside ``DataFrame.mapInArrow``: each task receives its partition as Arrow record batches,
checks them (nulls, NaNs, lengths), compacts sparse vectors, splits train/validation rows and writes
Parquet files of at most ``max_file_bytes`` into the store with pyarrow. With ``slices`` > 1 (a
partition written without a shuffle) each batch is cut into ``slices`` contiguous parts and part
``k`` goes to its own files, named ``s{k}-part-...``: sorted by name, slice ``k``'s files are the
``k``-th share a reader cuts for ``slices`` ranks, so every rank gets rows of every input
partition, as the shuffle would give it. It yields one JSON line per
file written plus one line of statistics, which the driver collects to build the metadata: no
directory listing or footer read is needed afterwards, and files of failed task attempts (which no
collected line names) are swept by the driver.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_estimators.data._arrow import invalid_rows, vector_udt_parts, vector_udt_sizes
from spark_estimators.data.metadata import SCHEMA_METADATA_KEY, ColumnInfo
from spark_estimators.errors import StoreError
from spark_estimators.store._filesystems import FilesystemSpec

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

INFO_SCHEMA = "info string"
_WRITE_BUFFER_BYTES = 1 << 20
MIN_ROW_GROUP_ROWS = 64
MAX_ROW_GROUP_ROWS = 1 << 20
#: Values pyarrow encodes per inner batch (its default is 1,024): 64k cut the writer's CPU by
#: ~12% on 32 float64 features (bench/RESULTS.md, issue 45 session 4). pyarrow checks its 1 MiB
#: data page size after each batch, so a page may run past it by up to one batch (512 KiB of
#: float64); readers read whole row groups, so that changes nothing for them.
WRITE_BATCH_VALUES = 1 << 16


def arrow_type(info: ColumnInfo) -> pa.DataType:
    """The Arrow type a column is stored with."""
    import pyarrow as pa

    if info.kind == "sparse_vector":
        return pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])
    scalar = pa.from_numpy_dtype(np.dtype(info.dtype))
    return scalar if info.kind == "scalar" else pa.list_(scalar)


def stored_schema(columns: tuple[ColumnInfo, ...]) -> pa.Schema:
    import pyarrow as pa

    payload = json.dumps([c.to_dict() for c in columns]).encode()
    return pa.schema(
        [pa.field(c.name, arrow_type(c)) for c in columns], metadata={SCHEMA_METADATA_KEY: payload}
    )


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    """Dictionary-encode integer and boolean scalars only.

    Floating-point features almost never repeat, and trying a dictionary on them first doubled the
    time pyarrow took to write a float column (measured: 1.13 s -> 0.67 s for 500k x 33 floats).
    """
    import pyarrow as pa

    return [f.name for f in schema if pa.types.is_integer(f.type) or pa.types.is_boolean(f.type)]


class _RollingParquetWriter:
    """Whole row groups (~``row_group_bytes``); new file past ``max_file_bytes``."""

    def __init__(
        self,
        fs: pafs.FileSystem,
        dir_url: str,
        dir_fs: str,
        stem: str,
        schema: pa.Schema,
        row_group_bytes: int,
        max_file_bytes: int,
    ) -> None:
        self._fs = fs
        self._dir_url = dir_url.rstrip("/")
        self._dir_fs = dir_fs
        self._stem = stem
        self._schema = schema
        self._row_group_bytes = row_group_bytes
        self._max_file_bytes = max_file_bytes
        self._group_rows = 0
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._seq = 0
        self._sink: Any = None
        self._writer: Any = None
        self._name = ""
        self._groups: list[int] = []
        self.files: list[dict[str, Any]] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if not self._group_rows:
            row_bytes = max(batch.nbytes / batch.num_rows, 1.0)
            self._group_rows = int(
                min(max(self._row_group_bytes // row_bytes, MIN_ROW_GROUP_ROWS), MAX_ROW_GROUP_ROWS)
            )
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self._group_rows:
            self._flush_group()

    def _flush_group(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._pending_rows:
            return
        table = pa.Table.from_batches(self._pending, self._schema)
        self._pending, self._pending_rows = [], 0
        if self._writer is None:
            self._name = f"{self._stem}-{self._seq:03d}.parquet"
            self._seq += 1
            self._sink = self._fs.open_output_stream(
                posixpath.join(self._dir_fs, self._name), buffer_size=_WRITE_BUFFER_BYTES
            )
            self._writer = pq.ParquetWriter(
                self._sink,
                self._schema,
                compression="snappy",
                use_dictionary=_dictionary_columns(self._schema),
                # Min/max of float columns: no reader of ours uses them, and computing them was
                # ~7% of the write's CPU on 32 float64 features (bench/RESULTS.md, issue 45).
                write_statistics=_dictionary_columns(self._schema),
                write_batch_size=WRITE_BATCH_VALUES,
            )
        # One call = one row group (the table is below pyarrow's row-group maximum).
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))
        self._groups.append(table.num_rows)
        if self._sink.tell() >= self._max_file_bytes:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        size = int(self._sink.tell())
        self._sink.close()
        self.files.append(
            {
                "path": f"{self._dir_url}/{self._name}",
                "rows": sum(self._groups),
                "bytes": size,
                "row_groups": self._groups,
            }
        )
        self._writer = self._sink = None
        self._groups = []

    def close(self) -> list[dict[str, Any]]:
        self._flush_group()
        self._close_file()
        return self.files

    def abort(self) -> None:
        """Close and delete everything this writer wrote (rows not yet written are dropped)."""
        self._pending, self._pending_rows = [], 0
        try:
            self._close_file()
        finally:
            for f in self.files:
                _delete_quietly(self._fs, posixpath.join(self._dir_fs, f["path"].rsplit("/", 1)[1]))
            self.files = []


@dataclass(frozen=True)
class PartitionWriter:
    """The function given to ``mapInArrow`` (module-level and picklable, no closures)."""

    spec: FilesystemSpec
    train_dir: str
    val_dir: str | None
    token: str
    columns: tuple[ColumnInfo, ...]
    split_col: str | None
    drop_invalid: bool
    row_group_bytes: int
    max_file_bytes: int
    rank_imports: tuple[str, ...] = ()  # the worker's zygote imports these meanwhile
    slices: int = 1  # >1: the partition was not shuffled; deal each batch over this many shares

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        from pyspark import TaskContext

        if self.rank_imports:  # the training stage's ranks fork from it (task/spare.py)
            from spark_estimators.task import spare

            spare.ensure(self.rank_imports)

        ctx = TaskContext.get()
        part, attempt = (ctx.partitionId(), ctx.attemptNumber()) if ctx else (0, 0)
        sink = self.open(part, attempt)
        try:
            for batch in batches:
                sink.write(batch)
            lines = sink.close()
        except BaseException:
            sink.abort()
            raise
        yield pa.RecordBatch.from_pydict({"info": lines})

    def open(self, part: int, attempt: int) -> PartitionSink:
        """The writers of partition ``part`` (task attempt ``attempt``), ready for its batches."""
        return PartitionSink(self, part, attempt)

    @staticmethod
    def _write_rows(
        writers: dict[tuple[str, int], _RollingParquetWriter],
        k: int,
        out: pa.RecordBatch,
        val_mask: np.ndarray | None,
    ) -> None:
        import pyarrow as pa

        if out.num_rows == 0:
            return
        if val_mask is None or ("val", k) not in writers:
            writers["train", k].write(out)
        else:
            writers["train", k].write(out.filter(pa.array(~val_mask)))
            writers["val", k].write(out.filter(pa.array(val_mask)))

    def _convert(
        self, batch: pa.RecordBatch, schema: pa.Schema, stats: dict[str, Any]
    ) -> tuple[pa.RecordBatch, np.ndarray | None, bool]:
        """Check and convert one batch; returns (stored batch, validation mask, has_errors)."""
        import pyarrow as pa

        drop = np.zeros(batch.num_rows, dtype=bool)
        has_errors = False
        for info in self.columns:
            column = batch.column(info.name)
            invalid, bad_length = invalid_rows(column, info)
            n_invalid, n_bad = int(invalid.sum()), int(bad_length.sum())
            if n_invalid:
                stats["invalid"][info.name] = stats["invalid"].get(info.name, 0) + n_invalid
                drop |= invalid
                has_errors = has_errors or not self.drop_invalid
            if n_bad:
                first = int(np.flatnonzero(bad_length)[0])
                if info.kind == "sparse_vector":
                    example = int(vector_udt_sizes(column)[first])
                else:
                    example = len(column[first])
                count, seen = stats["bad_length"].get(info.name, [0, None])
                stats["bad_length"][info.name] = [
                    count + n_bad,
                    seen if seen is not None else example,
                ]
                has_errors = True
        if has_errors:
            return batch.slice(0, 0), None, True
        any_drop = bool(drop.any())
        keep = pa.array(~drop) if any_drop else None
        stats["dropped"] += int(drop.sum())
        cols = []
        for info in self.columns:
            column = batch.column(info.name)
            if keep is not None:
                column = column.filter(keep)
            if info.kind == "sparse_vector":
                column = vector_udt_parts(column).to_arrow()
            elif column.type != arrow_type(info):
                column = column.cast(arrow_type(info))
            cols.append(column)
        out = pa.RecordBatch.from_arrays(cols, schema=schema)
        val_mask = None
        if self.split_col is not None:
            flags = batch.column(self.split_col).to_numpy(zero_copy_only=False).astype(bool)
            val_mask = flags[~drop] if any_drop else flags
        return out, val_mask, False


class PartitionSink:
    """One partition's writers: :meth:`write` checks, converts, splits and writes each batch.

    :meth:`close` returns the lines the driver collects (one JSON line per file written, then one
    of statistics); a partition with null/NaN values or rows of a wrong length writes no files,
    only counts them. Used by :class:`PartitionWriter` (``prepare_data``'s ``mapInArrow``) and by
    ``data="parquet+stream"``'s barrier tasks (:mod:`spark_estimators.task.stream_spill`).
    OSErrors of the store are raised as :class:`~spark_estimators.errors.StoreError`.
    """

    def __init__(self, plan: PartitionWriter, part: int, attempt: int) -> None:
        self.plan = plan
        self.part = part
        self.schema = stored_schema(plan.columns)
        self.stats: dict[str, Any] = {"rows_in": 0, "dropped": 0, "invalid": {}, "bad_length": {}}
        self.failed = False
        stem = f"part-{part:05d}-{plan.token}-a{attempt}"
        fs = plan.spec.create()
        self._writers: dict[tuple[str, int], _RollingParquetWriter] = {}
        for split, dir_url in (("train", plan.train_dir), ("val", plan.val_dir)):
            if dir_url is None:
                continue
            dir_fs = plan.spec.to_fs_path(dir_url)
            if plan.spec.needs_directories:
                with _store_errors(dir_url):
                    fs.create_dir(dir_fs, recursive=True)
            for k in range(plan.slices):
                name = stem if plan.slices == 1 else f"s{k:03d}-{stem}"
                self._writers[split, k] = _RollingParquetWriter(
                    fs,
                    dir_url,
                    dir_fs,
                    name,
                    self.schema,
                    plan.row_group_bytes,
                    plan.max_file_bytes,
                )

    def write(self, batch: pa.RecordBatch) -> None:
        """Check and write one Arrow batch of the partition (after a bad row: only count)."""
        plan = self.plan
        self.stats["rows_in"] += batch.num_rows
        with _store_errors(plan.train_dir):
            out, val_mask, bad = plan._convert(batch, self.schema, self.stats)
            self.failed = self.failed or bad
            if self.failed or out.num_rows == 0:
                return  # keep counting problems, stop writing
            rows = out.num_rows
            for k in range(plan.slices):
                lo, hi = k * rows // plan.slices, (k + 1) * rows // plan.slices
                part_mask = None if val_mask is None else val_mask[lo:hi]
                plan._write_rows(self._writers, k, out.slice(lo, hi - lo), part_mask)

    def close(self) -> list[str]:
        """Finish the files; the driver's lines (the files, then the statistics)."""
        with _store_errors(self.plan.train_dir):
            if self.failed:
                self.abort()
            files = [(split, w.close()) for (split, _), w in self._writers.items()]
        lines = [json.dumps({"split": s, **f}) for s, fl in files for f in fl]
        lines.append(json.dumps({"stats": self.stats, "partition": self.part}))
        return lines

    def abort(self) -> None:
        """Close and delete every file written (errors are not raised: a failure is on its way)."""
        for w in self._writers.values():
            with contextlib.suppress(Exception):
                w.abort()


@contextlib.contextmanager
def _store_errors(dir_url: str) -> Iterator[None]:
    """OSErrors from the store become StoreError naming the directory (the driver re-raises it)."""
    try:
        yield
    except StoreError:
        raise
    except OSError as exc:
        raise StoreError(f"cannot write the prepared data under {dir_url!r}: {exc}") from exc


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except OSError:
        pass
