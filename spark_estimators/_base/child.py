"""What every rank process does around the user's function: start, watch its parent, exit.

Shared by the rank processes of :func:`spark_estimators.run` (:mod:`spark_estimators.task.child`),
of ``run_elastic`` (:mod:`spark_estimators.elastic.worker`) and of the local launcher
(:mod:`spark_estimators.launch`). Imports stay light: a rank process starts with these.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any, NoReturn

#: The collective timeline module, flushed before exit when the rank used it (never imported here).
_TIMELINE_MODULE = "spark_estimators.collective.api.timeline"
#: An exit code as the status pipe of a forked rank carries it (task/zygote.py).
EXIT_CODE = struct.Struct("!i")
#: The write end of this process's status pipe, when a zygote forked it (else None).
_status_fd: int | None = None


def report_exit_code_to(fd: int) -> None:
    """Have :func:`exit_now` write the exit code to ``fd`` (a forked rank's status pipe).

    The zygote that forked the rank writes the code too when it reaps it, but a zygote that died
    first cannot: the rank's own word keeps a healthy rank healthy.
    """
    global _status_fd
    _status_fd = fd


def read_config() -> dict[str, Any]:
    """Read the rank's settings: a length-prefixed pickle that the parent task writes to stdin."""
    head = sys.stdin.buffer.read(4)
    if len(head) != 4:
        raise SystemExit("spark_estimators.task.child must be started by a Spark task")
    (n,) = struct.unpack("!I", head)
    return dict(pickle.loads(sys.stdin.buffer.read(n)))


def lifeline() -> None:
    """Read stdin until EOF, then kill this process group: EOF means the parent is gone."""
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, ValueError):
        pass
    # The parent is gone: take the whole process group (fn's own children too) with us.
    os.killpg(os.getpgrp(), signal.SIGKILL)


def start_lifeline() -> None:
    """Run :func:`lifeline` in a daemon thread."""
    threading.Thread(target=lifeline, name="se-lifeline", daemon=True).start()


def flush_streams() -> None:
    """Flush stdout and stderr, ignoring streams that are already closed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def report_failure(client: Any, exc: BaseException, who: dict[str, Any]) -> None:
    """Send the failure being handled to the driver (``failure`` request); stderr if that fails.

    ``who`` names the process to the driver (``{"rank": 3}``, ``{"worker_id": ...}``); the
    request adds the host, the exception in one line and the traceback.
    """
    tb = traceback.format_exc()
    flush_streams()
    try:
        client.call(
            "failure",
            {
                **who,
                "host": socket.gethostname(),
                "message": f"{type(exc).__name__}: {exc}",
                "traceback": tb,
            },
        )
    except Exception:
        sys.stderr.write(tb)


def exit_now(code: int) -> NoReturn:
    """Flush the collective timeline (when used) and the streams, then ``os._exit(code)``.

    ``os._exit`` skips atexit handlers (hence the explicit timeline flush) and never hangs at
    interpreter exit on threads or process groups that the user's function left behind (the
    collective engine's thread included).
    """
    timeline = sys.modules.get(_TIMELINE_MODULE)
    if timeline is not None:
        timeline.flush_all()
    flush_streams()
    if _status_fd is not None:
        try:
            os.write(_status_fd, EXIT_CODE.pack(code))
        except OSError:
            pass  # the task is gone: nobody to tell
    os._exit(code)


def pickle_return_value(value: object) -> bytes:
    """``fn``'s return value as cloudpickle bytes, or a TypeError that names what cannot travel.

    The value goes back to the driver; a lock, a generator, an open file or a CUDA stream
    cannot. The error says it is fn's return value (pickle's own message names only a type, as
    if fn itself had failed) and which part of it: ``fn's return value["model"].lock``.
    """
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(value))
    except Exception as exc:
        where, culprit = _unpicklable_part(value, "fn's return value", 4)
        kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}".removeprefix("builtins.")
        whole = "" if culprit is value else f" (a {type(value).__qualname__})"
        raise TypeError(
            f"fn's return value{whole} cannot be pickled to send it to the driver: {where} is "
            f"a {kind} ({type(exc).__name__}: {exc}). Return plain data (numbers, strings, "
            "lists, dicts, numpy arrays, a state_dict) instead."
        ) from exc


def _unpicklable_part(value: object, path: str, depth: int) -> tuple[str, object]:
    """The innermost part of ``value`` (looking into containers and attributes) that fails."""
    import cloudpickle

    if depth <= 0:
        return path, value
    if isinstance(value, dict):
        parts: list[tuple[str, object]] = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(getattr(value, "__dict__", None), dict):
        parts = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    else:
        return path, value
    for part_path, part in parts:
        try:
            cloudpickle.dumps(part)
        except Exception:
            return _unpicklable_part(part, part_path, depth - 1)
    return path, value
