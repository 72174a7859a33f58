"""Entry point of a rank process: ``python -m spark_estimators.task.child``.

Reads its connection details from stdin (length-prefixed pickle written by its parent task),
fetches the user's function from the driver, runs it and reports the result or the traceback.
A thread keeps reading stdin: EOF means the parent task is gone, and the rank kills its own
process group so nothing is left running. Imports stay light so the process starts fast.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any

from spark_estimators._base.child import (
    exit_now,
    flush_streams,
    pickle_return_value,
    read_config,
    start_lifeline,
)
from spark_estimators.task import context, lazy_dynamo

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


def main(config: dict[str, Any] | None = None) -> None:
    """Run one rank: fetch the function from the driver, run it, report its result or failure.

    ``config``: already read from stdin (a rank forked by the worker's zygote, see
    :mod:`spark_estimators.task.spare`); default read it now.
    """
    config = read_config() if config is None else config
    start_lifeline()
    if os.environ.get("SPARK_ESTIMATORS_STREAM_FIFO"):  # data="stream": the task's events
        from spark_estimators.task.stream_spill import open_stream_fifo

        open_stream_fifo()
    lazy_dynamo.install()  # eager training never pays for importing torch._dynamo
    context.set_task_started(config.get("task_started"))
    for name, when in config.get("task_marks", ()):
        context.mark(name, when)
    context.mark("config_read")

    import cloudpickle

    from spark_estimators.driver.rpc import RpcClient

    rank = int(config["rank"])
    client = RpcClient(tuple(config["driver_address"]), config["secret"], timeout=None)
    context.set_driver_client(client, rank)
    code = 0
    try:
        blob = client.call("fetch_fn", rank)
        context.mark("fn_fetched")
        fn, args, kwargs = cloudpickle.loads(blob)
        context.mark("fn_loaded")
        value = fn(*args, **(kwargs or {}))
        flush_streams()
        client.call("result", {"rank": rank, "value": pickle_return_value(value)})
        _wait_for_other_ranks(client)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        code = 1
        tb = traceback.format_exc()
        flush_streams()
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
    exit_now(code)


if __name__ == "__main__":
    main()
