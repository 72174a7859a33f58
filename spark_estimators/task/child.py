"""Entry point of a rank process: ``python -m spark_estimators.task.child``.

Reads its connection details from stdin (length-prefixed pickle written by its parent task),
fetches the user's function from the driver, runs it and reports the result or the traceback.
A thread keeps reading stdin: EOF means the parent task is gone, and the rank kills its own
process group so nothing is left running. Imports stay light so the process starts fast.
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
from typing import Any

from spark_estimators.task import context, lazy_dynamo


def _read_config() -> dict[str, Any]:
    head = sys.stdin.buffer.read(4)
    if len(head) != 4:
        raise SystemExit("spark_estimators.task.child must be started by a Spark task")
    (n,) = struct.unpack("!I", head)
    return dict(pickle.loads(sys.stdin.buffer.read(n)))


def _lifeline() -> None:
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, ValueError):
        pass
    # The parent task is gone: take the whole process group (fn's own children too) with us.
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


#: How long one "has every rank reported?" long poll waits at the driver.
ALL_REPORTED_POLL_S = 5.0


def _wait_for_other_ranks(client: Any) -> None:
    """Keep this process (and the rendezvous store rank 0 hosts) alive until all ranks reported.

    Returns when the driver says every rank has reported or the job is aborting, or when the
    driver cannot be asked (gone, or a service without this request): never waits forever
    beyond the job itself, since the driver ends the job on its own timeouts.
    """
    try:
        while not client.call("all_reported", ALL_REPORTED_POLL_S):
            pass
    except Exception:  # the driver is gone or does not serve the request: nothing to wait for
        return


def main() -> None:
    config = _read_config()
    threading.Thread(target=_lifeline, name="se-lifeline", daemon=True).start()
    lazy_dynamo.install()  # eager training never pays for importing torch._dynamo
    context.set_task_started(config.get("task_started"))

    import cloudpickle

    from spark_estimators.driver.rpc import RpcClient

    rank = int(config["rank"])
    client = RpcClient(tuple(config["driver_address"]), config["secret"], timeout=None)
    context.set_driver_client(client, rank)
    code = 0
    try:
        fn, args, kwargs = cloudpickle.loads(client.call("fetch_fn", rank))
        value = fn(*args, **(kwargs or {}))
        _flush()
        client.call("result", {"rank": rank, "value": cloudpickle.dumps(value)})
        _wait_for_other_ranks(client)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        code = 1
        tb = traceback.format_exc()
        _flush()
        try:
            client.call(
                "failure",
                {
                    "rank": rank,
                    "host": socket.gethostname(),
                    "message": f"{type(exc).__name__}: {exc}",
                    "traceback": tb,
                },
            )
        except Exception:
            sys.stderr.write(tb)
    timeline = sys.modules.get("spark_estimators.collective.api.timeline")
    if timeline is not None:  # os._exit skips atexit: write the collective timeline's tail
        timeline.flush_all()
    _flush()
    # os._exit: never hang at interpreter exit on threads or process groups fn left behind.
    os._exit(code)


if __name__ == "__main__":
    main()
