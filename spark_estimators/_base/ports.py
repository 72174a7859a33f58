"""The rendezvous port of a job: reserved by the process that advertises it, never let go early.

Rank 0's process hosts the rendezvous store (torch's ``TCPStore``) on ``MASTER_PORT``. The old
way, "bind port 0, read the number, close, advertise", leaves the port free from the probe
until rank 0 binds it, seconds later (rank processes start, import torch, run user code).
Anything on the host may take it in between: another job's probe gets the same number (the
kernel hands recently freed ports out again within a few calls), or an outgoing connection uses
it as its source port. Then a job's ranks meet another job's store, and gloo's join fails with
"Connection reset by peer", or rank 0 cannot bind at all.

:func:`reserve_port` keeps the socket: bound, not listening, with ``SO_REUSEADDR``. On Linux
that refuses every other bind of the port and every outgoing connection's use of it as a source
port, but lets a listener that also sets ``SO_REUSEADDR`` bind it: torch's ``TCPStore`` (libuv
and classic) does, and so do gRPC servers. The owner closes the reservation only after the
rank that uses the port has exited, so there is no moment when the advertised port is free.
"""

from __future__ import annotations

import socket


def reserve_port(host: str = "") -> socket.socket:
    """A socket bound to a free TCP port of ``host`` (all interfaces by default), held.

    The caller advertises ``sock.getsockname()[1]`` and keeps the socket open until the process
    that listens on the port has exited; a store on that port must set ``SO_REUSEADDR``.

    >>> with reserve_port() as held:
    ...     port = held.getsockname()[1]
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def reserved_port(sock: socket.socket) -> int:
    """The port number a :func:`reserve_port` socket holds."""
    return int(sock.getsockname()[1])
