r"""Spark's console stage bar, muted while our own output shows (reference counted).

Spark draws ``[Stage n:>   (a + b) / c]`` on the driver's stderr and redraws it with ``\r``;
lines printed meanwhile (a fit's epoch lines, the ranks' forwarded output) end up glued to it.
:data:`SPARK_CONSOLE_BAR` points the JVM's ConsoleProgressBar at a null stream while any user of
it holds it muted, and restores it after the last one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()


class _SparkConsoleBar:
    """Mutes the JVM's ConsoleProgressBar while anything displays its own output."""

    def __init__(self) -> None:
        self.count = 0
        self.saved: tuple[Any, Any, Any] | None = None  # (bar, field, original stream)
        self.failed = False

    def mute(self) -> bool:
        """Start muting (nested calls count); False when Spark's bar could not be muted."""
        with _lock:
            self.count += 1
            if self.count == 1:
                self.saved, self.failed = None, False
                try:
                    swapped = _swap_console_stream()
                except Exception as exc:  # noqa: BLE001 - any JVM/py4j failure means "cannot"
                    logger.debug("cannot mute Spark's console progress bar: %r", exc)
                    swapped = _NO_JVM
                self.failed = swapped is _NO_JVM
                self.saved = None if swapped is _NO_JVM else swapped
            return not self.failed

    def unmute(self) -> None:
        with _lock:
            self.count -= 1
            if self.count == 0 and self.saved is not None:
                bar, field, original = self.saved
                self.saved = None
                try:
                    bar.finishAll()  # forget the muted bar's last line before restoring
                    field.set(bar, original)
                except Exception as exc:  # noqa: BLE001
                    logger.debug("cannot restore Spark's console progress bar: %r", exc)

    @contextlib.contextmanager
    def muted(self) -> Iterator[bool]:
        """Mute for the block (e.g. a fit's ``prepare_data`` jobs); yields :meth:`mute`'s answer."""
        ok = self.mute()
        try:
            yield ok
        finally:
            self.unmute()


_NO_JVM: Any = object()


def _swap_console_stream() -> Any:
    """Point the active SparkContext's ConsoleProgressBar at a null stream; None: no bar."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None or getattr(sc, "_jsc", None) is None:
        return _NO_JVM  # Spark Connect or no session: nothing this process can mute
    option = sc._jsc.sc().progressBar()
    if not option.isDefined():
        return None  # spark.ui.showConsoleProgress is off: nothing to mute
    bar = option.get()
    jvm: Any = sc._jvm
    field = bar.getClass().getDeclaredField("console")
    field.setAccessible(True)
    original = field.get(bar)
    bar.finishAll()  # clear a stage bar drawn before this fit
    field.set(bar, jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
    return bar, field, original


SPARK_CONSOLE_BAR = _SparkConsoleBar()
