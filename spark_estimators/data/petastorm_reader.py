"""Optional petastorm reader (``make_batch_reader(..., reader="petastorm")``).

For environments that already have petastorm. petastorm 0.13.1 runs only with pyarrow 14,
pyspark <= 4.0.x and numpy < 2 (measured), so it is not a dependency of this package: see
``requirements-petastorm.txt`` for the pinned environment it is tested in. The wrapper keeps the
contract of :class:`~spark_estimators.data.reader.BatchReader`: every rank yields
``steps_per_epoch`` full batches (petastorm reads its row-group shard in an endless loop and we stop
after the last step), columns come out shaped per the metadata. Sparse vector columns are not
supported here (use the default reader).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from spark_estimators.data._pipeline import Batch
from spark_estimators.data.metadata import DatasetMetadata
from spark_estimators.data.options import TransformFn
from spark_estimators.data.shards import rank_and_size, steps_per_epoch
from spark_estimators.errors import ConfigurationError


def _import_petastorm() -> Any:
    try:
        import petastorm
    except ImportError as exc:
        raise ConfigurationError(
            "reader='petastorm' needs petastorm, which is not installed; it only works with "
            "pyarrow 14 / pyspark 4.0.x / numpy<2: pip install -r requirements-petastorm.txt && "
            "pip install --no-deps petastorm==0.13.1 (or use the default reader='arrow')"
        ) from exc
    return petastorm


class PetastormBatchReader:
    """petastorm's ``make_batch_reader`` rebatched to full batches and equal steps per rank."""

    def __init__(
        self,
        store: Any,
        metadata: DatasetMetadata,
        *,
        split: str = "train",
        rank: int | None = None,
        size: int | None = None,
        batch_size: int = 32,
        columns: Sequence[str] | None = None,
        shuffle: bool = True,
        seed: int | None = 0,
        epoch: int = 0,
        shuffle_buffer_size: int | None = None,
        inmemory_cache: bool = False,
        transformation_fn: TransformFn | None = None,
        stack_columns: Mapping[str, Sequence[str]] | None = None,
        prefetch: int = 2,
        num_workers: int = 1,
    ) -> None:
        _import_petastorm()
        self.rank, self.size = rank_and_size(rank, size)
        self.store = store
        self.metadata = metadata
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.epoch = epoch
        self.num_workers = num_workers
        self.transformation_fn = transformation_fn
        names = (
            list(columns)
            if columns is not None
            else (
                metadata.feature_cols
                + metadata.label_cols
                + ([metadata.sample_weight_col] if metadata.sample_weight_col else [])
            )
        )
        self.columns = {c: metadata.columns[c] for c in names}
        sparse = [c for c, info in self.columns.items() if info.is_sparse]
        if sparse or stack_columns or inmemory_cache:
            raise ConfigurationError(
                f"reader='petastorm' does not support sparse columns {sparse!r}, stack_columns or "
                "inmemory_cache; use reader='arrow'"
            )
        self.steps_per_epoch = steps_per_epoch(metadata.rows(split), self.size, batch_size)
        self.urls = [store.full_path(f.path) for f in metadata.files(split)]

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (it seeds the shuffle order of the next pass)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        from petastorm import make_batch_reader as petastorm_reader

        epoch = self.epoch
        self.epoch += 1
        urls = [u if "://" in u else "file://" + u for u in self.urls]
        transform = None
        if self.transformation_fn is not None:
            from petastorm import TransformSpec

            transform = TransformSpec(self.transformation_fn)
        with petastorm_reader(
            urls,
            schema_fields=list(self.columns),
            cur_shard=self.rank,
            shard_count=self.size,
            shuffle_row_groups=self.shuffle,
            seed=self.seed + epoch,
            num_epochs=None,
            workers_count=self.num_workers,
            transform_spec=transform,
            storage_options=getattr(self.store, "storage_options", None),
        ) as reader:
            yield from self._rebatch(reader)

    def _rebatch(self, reader: Any) -> Iterator[Batch]:
        bs = self.batch_size
        rest: Batch | None = None
        emitted = 0
        for group in reader:
            block = {name: self._column(getattr(group, name), name) for name in self.columns}
            if rest is not None:
                block = {k: np.concatenate([rest[k], block[k]]) for k in block}
                rest = None
            n = len(next(iter(block.values())))
            start = 0
            while start + bs <= n:
                yield {k: v[start : start + bs] for k, v in block.items()}
                emitted, start = emitted + 1, start + bs
                if emitted == self.steps_per_epoch:
                    return
            rest = {k: v[start:] for k, v in block.items()}

    def _column(self, values: Any, name: str) -> np.ndarray:
        info = self.columns[name]
        if values.dtype == object:  # petastorm hands list columns over as arrays of arrays
            values = np.stack(values)
        return np.asarray(values, dtype=info.dtype).reshape((-1, *info.shape))
