"""TensorBoard scalars of a ``TorchEstimator`` run (rank 0), synced to ``get_logs_path(run_id)``."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spark_estimators.core.rank import light_tensorboard
from spark_estimators.store.layout import LOGS_SUBDIR
from spark_estimators.task.scratch import make_temp_dir

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)


class TensorBoardScalars:
    """Scalars into a local event dir, synced to the run's logs/ in the store after each epoch."""

    def __init__(self, store: StoreBase, run_id: str):
        self.store, self.run_id = store, run_id
        # Removed by close() (or with the rank's scratch).
        self.local = make_temp_dir("se-tb-")
        self.writer: SummaryWriter | None = None
        try:
            light_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.local)
        except ImportError:
            logger.warning("tensorboard is not installed: no TensorBoard logs for this run")

    def log(self, epoch: int, logs: Mapping[str, object]) -> None:
        """Write the epoch's float metrics and sync the event dir to the store."""
        if self.writer is None:
            return
        for key, value in logs.items():
            if key != "epoch" and isinstance(value, float):
                self.writer.add_scalar(key, value, epoch)
        self.writer.flush()
        self.store.sync_dir(self.local, self.run_id, subdir=LOGS_SUBDIR)

    def close(self) -> None:
        """Close the writer and remove the local event dir."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)
