"""Printing the ranks' output on the driver, each line prefixed with its rank."""

from __future__ import annotations

import sys
import threading
from datetime import datetime
from typing import IO


class OutputPrinter:
    """Writes rank output to the given streams, each line prefixed with ``[rank]``."""

    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None, timestamp: bool):
        self._stdout = stdout
        self._stderr = stderr
        self._timestamp = timestamp
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, lines: list[str]) -> None:
        out = self._stderr if stream == "stderr" else self._stdout
        if out is None:
            out = sys.stderr if stream == "stderr" else sys.stdout
        stamp = ""
        if self._timestamp:
            stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " "
        text = "".join(f"[{rank}]{stamp and ' ' + stamp}{line}\n" for line in lines)
        with self._lock:
            out.write(text)
            out.flush()
