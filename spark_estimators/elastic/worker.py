"""Entry point of an elastic rank process: ``python -m spark_estimators.elastic.worker``.

Like :mod:`spark_estimators.task.child`, but the rank is not fixed: before the user's function
runs and after every reset, :func:`rendezvous` asks the driver for this worker's place in the
next round and rewrites the rank environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ours)
in this process, so :func:`spark_estimators.collective.init` joins the new group. It installs the
driver hooks of :mod:`spark_estimators.collective.api.elastic`.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from spark_estimators._base.child import (
    exit_now,
    flush_streams,
    pickle_return_value,
    read_config,
    report_failure,
    start_lifeline,
)
from spark_estimators.task import lazy_dynamo

if TYPE_CHECKING:
    from spark_estimators.driver.rpc import RpcClient


class _Rendezvous:
    """The link of this worker to the elastic driver service."""

    def __init__(self, client: RpcClient, worker_id: str, backend: str):
        self.client, self.worker_id, self.backend = client, worker_id, backend
        self.round = 0
        self.rank = -1
        #: The port this worker offered for the current round, held while the round may use it.
        self._reservation: socket.socket | None = None

    def __call__(self) -> bool:
        """Join the next round; False when the job finished without this worker.

        The port offered is held (:func:`~spark_estimators._base.ports.reserve_port`) until the
        next round: if the driver makes this worker rank 0, its store binds that port in this
        process with nothing able to take it first. The previous round's is let go only now.
        """
        from spark_estimators._base.ports import reserve_port, reserved_port
        from spark_estimators.task.spark_task import rank_environment

        previous, self._reservation = self._reservation, reserve_port()
        if previous is not None:
            previous.close()
        port = reserved_port(self._reservation)
        reply = self.client.call("rendezvous", {"worker_id": self.worker_id, "port": port})
        if reply.get("done"):
            return False
        settings = reply["settings"]
        if settings.rank != 0:
            self._reservation.close()  # rank 0's worker holds this round's rendezvous port
        self.round, self.rank = int(reply["round"]), int(settings.rank)
        os.environ.update(rank_environment(settings, (), self.backend))
        return True

    def reset(self) -> None:
        if not self():
            # The job finished while this worker waited: nothing left to do.
            exit_now(0)

    def host_updates(self) -> bool:
        return bool(self.client.call("host_updates", self.round))


def main() -> None:
    """Run one elastic worker: meet the driver, run the function, report, exit."""
    config = read_config()
    start_lifeline()
    lazy_dynamo.install()  # as in task.child: eager training never imports torch._dynamo

    import cloudpickle

    from spark_estimators.collective.api import elastic
    from spark_estimators.driver.rpc import RpcClient
    from spark_estimators.task import context

    wid = str(config["worker_id"])
    client = RpcClient(tuple(config["driver_address"]), config["secret"], timeout=None)
    context.set_driver_client(client, int(config["index"]))
    link = _Rendezvous(client, wid, str(config.get("backend") or "auto"))
    code = 0
    try:
        if not link():
            exit_now(0)
        elastic.set_driver_hooks(link.reset, link.host_updates)
        fn, args, kwargs = cloudpickle.loads(client.call("fetch_fn", wid))
        value = fn(*args, **(kwargs or {}))
        flush_streams()
        client.call(
            "result",
            {
                "worker_id": wid,
                "round": link.round,
                "rank": link.rank,
                "value": pickle_return_value(value),
            },
        )
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        code = 1
        report_failure(client, exc, {"worker_id": wid})
    exit_now(code)


if __name__ == "__main__":
    main()
