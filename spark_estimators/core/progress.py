"""Driver-side progress of a fit: a tqdm bar (terminal or notebook) and one line per epoch."""

from __future__ import annotations

import sys
import threading
from typing import Any


def format_metrics(logs: dict[str, Any]) -> str:
    parts = []
    for key, value in logs.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, int):
            parts.append(f"{key}={value}")
    return " ".join(parts)


class EpochProgress:
    """Receives ``("epoch", logs)`` events from rank 0 and shows them.

    Used as the ``event_callback`` of :func:`spark_estimators.run`. ``history`` keeps every
    epoch's logs, so a driver-side view exists even if training fails later.
    """

    def __init__(self, epochs: int, verbose: int = 1, start_epoch: int = 0):
        self.verbose = verbose
        self.epochs = epochs
        self.history: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._bar: Any = None
        if verbose >= 1 and epochs > 0:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=epochs, initial=start_epoch, desc="epochs", unit="epoch", file=sys.stderr
            )

    def __call__(self, rank: int, kind: str, data: Any) -> None:
        if kind != "epoch":
            return
        with self._lock:
            self.history.append(dict(data))
            if self._bar is not None:
                self._bar.set_postfix_str(format_metrics(data), refresh=False)
                self._bar.update(1)
            if self.verbose >= 1:
                line = f"epoch {data.get('epoch')}: {format_metrics(data)}"
                if self._bar is not None:
                    self._bar.write(line, file=sys.stdout)
                else:
                    print(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
