"""What every framework's rank needs: the base of the torch, Lightning and Keras train specs.

A spec is built on the driver by :meth:`SparkEstimator._spec_fields` plus the framework's own
fields, pickled into the launch, and read by the framework's ``remote.train`` on every rank.
User objects (models, losses, callbacks) travel inside ``user_blob``, pickled by value. The
ranks' readers are built from these fields by :func:`spark_estimators.core.rank.reader_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_estimators.data.metadata import DatasetMetadata
    from spark_estimators.store.base import StoreBase


@dataclass(kw_only=True)
class TrainSpec:
    """Fields shared by every framework's spec (all keyword-only)."""

    user_blob: bytes
    store: StoreBase
    meta: DatasetMetadata
    run_id: str
    feature_cols: list[str]
    label_cols: list[str]
    sample_weight_col: str | None
    input_shapes: list[list[int] | None] | None
    label_shapes: list[list[int] | None] | None
    batch_size: int
    val_batch_size: int
    epochs: int
    start_epoch: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    shuffle: bool
    seed: int | None
    inmemory_cache_all: bool
    use_gpu: bool | None
    reader: str
    train_reader_num_workers: int
    val_reader_num_workers: int
    history: list[dict[str, float]] = field(default_factory=list)
    shuffle_buffer_size: int | None = None  # None: the reader's default; 0: no shuffling
    # Average normalisation running statistics over the ranks when training ends.
    average_running_stats: bool = False
    # reader='petastorm' only: petastorm's pool and the TransformSpec schema changes.
    reader_pool_type: str = "thread"
    transformation_edit_fields: list[Any] | None = None
    transformation_removed_fields: list[str] | None = None
    # Feature/label columns the ranks cast to int64 class indices (decided in the driver).
    index_cols: list[str] = field(default_factory=list)
