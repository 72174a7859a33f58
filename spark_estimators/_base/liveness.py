"""Whether the process that left something behind (a run lock, a scratch dir) still runs.

A pid means something only in the kernel boot and pid namespace it came from, and only for
the process that had it then: :func:`process_id` records all three (boot id, pid namespace,
pid, start time), :func:`is_gone` answers from such a record. Off Linux (no ``/proc``) the
answer is always "not known to be gone", so callers fall back to their timeouts.
"""

from __future__ import annotations

import os


def host_id() -> str:
    """The kernel boot id and pid namespace of this process ("" off Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def start_time(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot ("" when unknown or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""  # field 22 of proc(5), after "(comm)"


def process_id(pid: int | None = None) -> dict[str, object]:
    """What identifies ``pid`` (default: this process) for a later :func:`is_gone`."""
    pid = os.getpid() if pid is None else pid
    return {"host_id": host_id(), "pid": pid, "start": start_time(pid)}


def is_gone(host: str, pid: int, start: str = "") -> bool:
    """True only when the process ran in this kernel and pid namespace and no longer runs.

    ``start`` (from :func:`start_time`), when known, tells a reused pid from the original.
    """
    ours = host_id()
    if not ours or host != ours or pid <= 0:
        return False
    now = start_time(pid)
    if not now:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: it exists, owned by another user
            return False
        return False
    return bool(start) and now != start
