"""DatasetMetadata: what prepare_data wrote, enough for readers and estimators to use it.

The metadata is saved as JSON next to the training data (``{train_path}.{idx}.metadata.json``,
see :mod:`spark_estimators.store.base`); it is written last, so a dataset whose metadata exists is
complete. The per-column facts are also written into every Parquet
file's schema metadata (key ``spark_estimators.columns``), so :meth:`DatasetMetadata.from_parquet`
recovers shapes and sparse sizes from the files alone.

Column kinds
------------
``scalar``          one number per row; batches are ``[batch]``.
``array``           a fixed-length list per row; batches are ``[batch, n]``.
``vector``          an ML Dense/SparseVector stored dense (``vector_to_array``); ``[batch, n]``.
``sparse_vector``   an ML vector stored compactly as ``struct<indices, values>``
                    (``compress_sparse``); the reader re-densifies it to ``[batch, n]``.
``vector_udt``      an ML vector column written by Spark itself (``struct<type, size, indices,
                    values>``), found in existing Parquet data; the reader densifies it too.
"""

from __future__ import annotations

import datetime as _dt
import json
import posixpath
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from spark_estimators.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    import pyarrow as pa

    from spark_estimators.store.base import StoreBase

FORMAT_VERSION = 1
SCHEMA_METADATA_KEY = b"spark_estimators.columns"
KINDS = ("scalar", "array", "vector", "sparse_vector", "vector_udt")
SPLITS = ("train", "val")


@dataclass(frozen=True)
class ColumnInfo:
    """One stored column.

    Attributes
    ----------
    name
        Column name.
    kind
        One of ``scalar``, ``array``, ``vector``, ``sparse_vector``, ``vector_udt``.
    dtype
        numpy dtype name of the values the reader yields (``float32`` for the dense ML vectors
        ``prepare_data`` writes, ``float64`` for sparse and ``VectorUDT`` ones).
    shape
        Shape of one row: ``()`` for scalars, ``(n,)`` otherwise.
    spark_type
        The Spark SQL type it came from (``simpleString``), for messages.
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    spark_type: str = ""

    @property
    def is_sparse(self) -> bool:
        """True for a sparse vector column (stored as indices and values)."""
        return self.kind in ("sparse_vector", "vector_udt")

    @property
    def size(self) -> int:
        """Number of values per row (the product of ``shape``)."""
        out = 1
        for dim in self.shape:
            out *= dim
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the column."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ColumnInfo:
        """The column of a :meth:`to_dict` dict."""
        return cls(d["name"], d["kind"], d["dtype"], tuple(d["shape"]), d.get("spark_type", ""))


@dataclass(frozen=True)
class ParquetFileInfo:
    """One Parquet file of a split: full store path, rows, bytes, rows of each row group."""

    path: str
    rows: int
    bytes: int
    row_groups: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the file."""
        return {
            "path": self.path,
            "rows": self.rows,
            "bytes": self.bytes,
            "row_groups": list(self.row_groups),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParquetFileInfo:
        """The file of a :meth:`to_dict` dict."""
        return cls(d["path"], int(d["rows"]), int(d["bytes"]), tuple(d["row_groups"]))


@dataclass
class DatasetMetadata:
    """What a prepared dataset holds and where. Picklable; usable as a context manager.

    Leaving the ``with`` block does not delete anything (the data stays for reuse); delete a dataset
    with ``store.delete_dataset(meta.dataset_idx)``.
    """

    dataset_idx: str | None
    cache_key: str
    columns: dict[str, ColumnInfo]
    feature_cols: list[str]
    label_cols: list[str]
    sample_weight_col: str | None
    train_path: str
    val_path: str | None
    train_files: list[ParquetFileInfo]
    val_files: list[ParquetFileInfo] = field(default_factory=list)
    params: dict[str, object] = field(default_factory=dict)
    created_at: str = ""
    format_version: int = FORMAT_VERSION

    # ------------------------------------------------------------------------------ facts
    @property
    def train_rows(self) -> int:
        """Rows of the training split."""
        return sum(f.rows for f in self.train_files)

    @property
    def val_rows(self) -> int:
        """Rows of the validation split (0 without one)."""
        return sum(f.rows for f in self.val_files)

    @property
    def train_bytes(self) -> int:
        """Bytes of the training split's files."""
        return sum(f.bytes for f in self.train_files)

    @property
    def val_bytes(self) -> int:
        """Bytes of the validation split's files."""
        return sum(f.bytes for f in self.val_files)

    @property
    def has_val(self) -> bool:
        """True when there is validation data."""
        return self.val_rows > 0

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-row shape of every column."""
        return {name: col.shape for name, col in self.columns.items()}

    @property
    def dtypes(self) -> dict[str, str]:
        """Column name -> numpy dtype name."""
        return {name: col.dtype for name, col in self.columns.items()}

    def files(self, split: str = "train") -> list[ParquetFileInfo]:
        """The Parquet files of ``split`` (``"train"`` or ``"val"``)."""
        if split not in SPLITS:
            raise ConfigurationError(f"split {split!r} is not one of {SPLITS!r}")
        return self.train_files if split == "train" else self.val_files

    def rows(self, split: str = "train") -> int:
        """Rows of ``split`` (``"train"`` or ``"val"``)."""
        return sum(f.rows for f in self.files(split))

    def __enter__(self) -> DatasetMetadata:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    # ---------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole metadata (``format_version`` included)."""
        return {
            "format_version": self.format_version,
            "dataset_idx": self.dataset_idx,
            "cache_key": self.cache_key,
            "columns": [c.to_dict() for c in self.columns.values()],
            "feature_cols": list(self.feature_cols),
            "label_cols": list(self.label_cols),
            "sample_weight_col": self.sample_weight_col,
            "train_path": self.train_path,
            "val_path": self.val_path,
            "train_files": [f.to_dict() for f in self.train_files],
            "val_files": [f.to_dict() for f in self.val_files],
            "params": self.params,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetMetadata:
        """The metadata of a :meth:`to_dict` dict; raise on an unknown ``format_version``."""
        version = int(d.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise StoreError(
                f"dataset metadata has format_version {version!r}, newer than this "
                f"spark_estimators understands ({FORMAT_VERSION}); upgrade spark_estimators"
            )
        return cls(
            dataset_idx=d.get("dataset_idx"),
            cache_key=d.get("cache_key", ""),
            columns={c["name"]: ColumnInfo.from_dict(c) for c in d["columns"]},
            feature_cols=list(d["feature_cols"]),
            label_cols=list(d["label_cols"]),
            sample_weight_col=d.get("sample_weight_col"),
            train_path=d["train_path"],
            val_path=d.get("val_path"),
            train_files=[ParquetFileInfo.from_dict(f) for f in d["train_files"]],
            val_files=[ParquetFileInfo.from_dict(f) for f in d.get("val_files", [])],
            params=dict(d.get("params", {})),
            created_at=d.get("created_at", ""),
            format_version=version,
        )

    def to_json(self) -> str:
        """The metadata as JSON (sorted keys), as stored next to the data."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetMetadata:
        """The metadata of a :meth:`to_json` text."""
        return cls.from_dict(json.loads(text))

    def save(self, store: StoreBase) -> str:
        """Write the metadata next to the data (atomically); returns its path."""
        path = store.get_dataset_metadata_path(self.dataset_idx)
        store.write_text(path, self.to_json(), atomic=True)
        return str(path)

    @classmethod
    def load(cls, store: StoreBase, dataset_idx: int | str | None = None) -> DatasetMetadata:
        """Read the metadata of dataset ``dataset_idx`` from ``store``.

        With ``dataset_idx=None``: the un-indexed dataset if the store has one (horovod's
        ``train_path`` data prepared by hand), else the most recently prepared dataset.
        """
        path = store.get_dataset_metadata_path(dataset_idx)
        known = store.list_datasets()
        if dataset_idx is None and known and not store.exists(path):
            found = [
                cls.from_json(store.read_text(store.get_dataset_metadata_path(i))) for i in known
            ]
            return max(found, key=lambda m: (m.created_at, str(m.dataset_idx)))
        if not store.exists(path):
            raise StoreError(
                f"no prepared dataset {dataset_idx!r} in {store!r} (looked for {path!r}); "
                f"prepared datasets there: {known!r}. Run prepare_data first, or use "
                "DatasetMetadata.from_parquet for Parquet written elsewhere"
            )
        return cls.from_json(store.read_text(path))

    # ------------------------------------------------------------- existing Parquet data
    @classmethod
    def from_parquet(
        cls,
        store: StoreBase,
        train_path: str | None = None,
        val_path: str | None = None,
        *,
        feature_cols: Sequence[str] | None = None,
        label_cols: Sequence[str] | None = None,
        sample_weight_col: str | None = None,
    ) -> DatasetMetadata:
        """Describe existing Parquet data (a directory or one file) from the files alone.

        Defaults to the store's un-indexed train/val paths (horovod's ``fit_on_parquet``). Column
        facts come from our schema metadata when the files were written by ``prepare_data``,
        else from the Arrow schema plus the first row (for list lengths and vector sizes).
        """
        train_path = train_path or store.get_train_data_path()
        train_files = list_parquet_files(store, train_path)
        if not train_files:
            raise StoreError(f"no Parquet files under {train_path!r} in {store!r}")
        if val_path is None and store.exists(store.get_val_data_path()):
            val_path = store.get_val_data_path()
        val_files = list_parquet_files(store, val_path) if val_path else []
        columns = infer_columns(store, train_files[0].path)
        wanted = list(feature_cols or []) + list(label_cols or [])
        if sample_weight_col:
            wanted.append(sample_weight_col)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise ConfigurationError(
                f"columns {missing!r} are not in the Parquet data at {train_path!r}; "
                f"available: {sorted(columns)!r}"
            )
        if wanted:
            columns = {name: columns[name] for name in wanted}
        return cls(
            dataset_idx=None,
            cache_key="",
            columns=columns,
            feature_cols=list(feature_cols or []),
            label_cols=list(label_cols or []),
            sample_weight_col=sample_weight_col,
            train_path=train_path,
            val_path=val_path,
            train_files=train_files,
            val_files=val_files,
            created_at=now_iso(),
        )


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def list_parquet_files(store: StoreBase, path: str) -> list[ParquetFileInfo]:
    """Footer facts of every Parquet file under ``path`` (hidden ``_``/``.`` names skipped)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = store.filesystem
    root = store.fs_path(path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        infos = [info]
    elif info.type == pafs.FileType.Directory:
        infos = [
            i
            for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
            if i.type == pafs.FileType.File
            and not any(
                p.startswith(("_", ".")) for p in posixpath.relpath(i.path, root).split("/")
            )
        ]
    else:
        return []
    full_root = store.full_path(path).rstrip("/")
    out = []
    for i in sorted(infos, key=lambda x: x.path):
        with fs.open_input_file(i.path) as f:
            md = pq.ParquetFile(f).metadata
        groups = tuple(md.row_group(k).num_rows for k in range(md.num_row_groups))
        rel = posixpath.relpath(i.path, root)
        full = full_root if rel == "." else f"{full_root}/{rel}"
        out.append(ParquetFileInfo(full, int(md.num_rows), int(i.size or 0), groups))
    return out


def infer_columns(store: StoreBase, file_path: str) -> dict[str, ColumnInfo]:
    """Column facts of one Parquet file: from our schema metadata, else from its data."""
    import pyarrow.parquet as pq

    with store.filesystem.open_input_file(store.fs_path(file_path)) as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow
        ours = (schema.metadata or {}).get(SCHEMA_METADATA_KEY)
        if ours:
            cols = [ColumnInfo.from_dict(c) for c in json.loads(ours)]
            return {c.name: c for c in cols}
        first = pf.read_row_group(0) if pf.metadata.num_row_groups else schema.empty_table()
    return {name: infer_column(name, first.column(name)) for name in schema.names}


def infer_column(name: str, column: pa.Array | pa.ChunkedArray) -> ColumnInfo:
    """Kind, dtype and shape of an Arrow column (lengths and sizes from its first valid row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    typ = column.type
    if pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ):
        return ColumnInfo(name, "scalar", _numpy_name(typ), (), str(typ))
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        value = typ.value_type
        if not (
            pa.types.is_integer(value) or pa.types.is_floating(value) or pa.types.is_boolean(value)
        ):
            raise ConfigurationError(f"column {name!r} has unsupported type {typ}")
        lengths = pc.drop_null(pc.list_value_length(column))
        if len(lengths) == 0:
            raise ConfigurationError(f"cannot infer the length of list column {name!r}: no rows")
        return ColumnInfo(name, "array", _numpy_name(value), (int(lengths[0].as_py()),), str(typ))
    if pa.types.is_struct(typ) and {"indices", "values"} <= {f.name for f in typ}:
        names = {f.name for f in typ}
        if "size" in names:  # Spark's VectorUDT layout
            sizes = column.combine_chunks().field("size")
            values = column.combine_chunks().field("values")
            size = None
            for i in range(len(column)):
                if sizes[i].is_valid:
                    size = sizes[i].as_py()
                    break
                if values[i].is_valid:
                    size = len(values[i])
                    break
            if size is None:
                raise ConfigurationError(f"cannot infer the size of vector column {name!r}")
            return ColumnInfo(name, "vector_udt", "float64", (int(size),), "vector")
    raise ConfigurationError(
        f"column {name!r} has unsupported Parquet type {typ}; supported: numbers, booleans, "
        "lists of numbers and Spark ML vectors"
    )


def _numpy_name(arrow_type: pa.DataType) -> str:
    import numpy as np

    return np.dtype(arrow_type.to_pandas_dtype()).name
