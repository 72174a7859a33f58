"""Printing the ranks' output on the driver, each line prefixed with its rank; a quiet JVM start.

:func:`quiet_jvm_start` starts Spark's JVM without its start-up banner on stderr (the lines of
:data:`JVM_BANNER`), which a notebook would show as warnings.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import IO

# TensorFlow's start-up lines (absl logs before InitializeLog, oneDNN and CPU-feature notes):
# TF_CPP_MIN_LOG_LEVEL does not reach them in TF 2.21, and they carry nothing to act on.
TF_STARTUP = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|^I\d{4} [\d:. ]+\s+\d+ (port|cpu_feature_guard)\.cc:\d+\] "
    r"|^To enable the following instructions: .* rebuild TensorFlow with"
)


class OutputPrinter:
    """Writes rank output to the given streams, each line prefixed with ``[rank]``.

    TensorFlow's start-up lines (:data:`TF_STARTUP`) are dropped: every Keras rank prints them.
    """

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
        kept = [line for line in lines if not TF_STARTUP.search(line)]
        if not kept:
            return
        text = "".join(f"[{rank}]{stamp and ' ' + stamp}{line}\n" for line in kept)
        with self._lock:
            out.write(text)
            out.flush()


# The JVM's start-up lines on stderr that say nothing a user must act on (Spark 4, Java 17+).
JVM_BANNER = re.compile(
    r"WARNING: Using incubator modules: jdk\.incubator\.vector"
    r"|Using Spark's default log4j profile: "
    r'|Setting default log level to "\w+"\.'
    r"|To adjust logging level use sc\.setLogLevel\(newLevel\)\."
    r"|WARN NativeCodeLoader: Unable to load native-hadoop library"
)


def _noise(line: bytes) -> bool:
    text = line.decode("utf-8", "replace")
    return bool(JVM_BANNER.search(text) or TF_STARTUP.search(text))


def _forward_filtered(read_fd: int, write_fd: int) -> None:
    """Copy lines from ``read_fd`` to ``write_fd``, dropping banner and TF start-up lines."""
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as source:
        while True:
            chunk = source.read(65536)
            if not chunk:
                break
            pending += chunk
            # Complete pieces end with \n, or with \r (a redrawn bar); a partial line waits for
            # its end, so a line split across reads is still recognised.
            end = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            pieces = re.split(rb"(?<=[\r\n])", pending[:end])
            pending = pending[end:]
            data = b"".join(p for p in pieces if p and not _noise(p))
            while data:
                try:
                    data = data[os.write(write_fd, data) :]
                except OSError:
                    return
    if pending:
        with contextlib.suppress(OSError):
            os.write(write_fd, pending)
    with contextlib.suppress(OSError):
        os.close(write_fd)


@contextlib.contextmanager
def quiet_jvm_start() -> Iterator[None]:
    """Start a JVM inside the block without its banner lines on stderr.

    A JVM started here inherits, as its stderr, a pipe that a daemon thread copies to this
    process's stderr line by line, dropping :data:`JVM_BANNER` lines; everything else the JVM
    (and the Python workers it forks) writes later passes through unchanged, for as long as the
    JVM lives. Where file descriptor 2 cannot be swapped, the block runs as it is.
    """
    try:
        saved = os.dup(2)
        read_fd, write_fd = os.pipe()
    except OSError:
        yield
        return
    forward_to = os.dup(saved)
    threading.Thread(
        target=_forward_filtered,
        args=(read_fd, forward_to),
        name="spark_estimators-jvm-stderr",
        daemon=True,
    ).start()
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        with _without_driver_only_env():
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # this process writes to its own stderr again; the JVM keeps the pipe
        os.close(saved)


# Set by quiet_driver_tensorflow for this (driver) process only; hidden from JVMs started later.
_DRIVER_ONLY_ENV: dict[str, str] = {}


def quiet_driver_tensorflow() -> None:
    """Keep a later ``import tensorflow`` in this driver process from printing its start-up lines.

    TensorFlow 2.21 prints its oneDNN note through absl before any setting is read, unless
    oneDNN is off (``TF_ENABLE_ONEDNN_OPTS=0``). The driver only builds and compiles Keras
    models (the ranks train them), so there it is turned off, for this process only: a JVM
    started later by :func:`quiet_jvm_start` (and so its executors and ranks) does not inherit
    it. Variables the user set are left as they are; nothing changes once TF is imported.
    """
    if "tensorflow" in sys.modules:
        return
    for key, value in (("TF_CPP_MIN_LOG_LEVEL", "1"), ("TF_ENABLE_ONEDNN_OPTS", "0")):
        if key not in os.environ:
            os.environ[key] = value
            _DRIVER_ONLY_ENV[key] = value


@contextlib.contextmanager
def _without_driver_only_env() -> Iterator[None]:
    hidden = {k: v for k, v in _DRIVER_ONLY_ENV.items() if os.environ.get(k) == v}
    for key in hidden:
        del os.environ[key]
    try:
        yield
    finally:
        for key, value in hidden.items():
            os.environ.setdefault(key, value)
