"""The parent's side of a rank process: killing its process group, saying how it ended.

Shared by the Spark task (:mod:`spark_estimators.task.spark_task`), the elastic task and the
local launcher (:mod:`spark_estimators.launch`). Each rank process leads its own process group,
so a signal to the group reaches the processes the user's function started too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import IO, Protocol


class RankProcess(Protocol):
    """What a task needs of its rank process (``subprocess.Popen`` or a forked ``ForkedRank``)."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end and return the exit code."""


def start_rank_process(module: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``python -m module`` as the leader of a new process group, all three pipes open.

    Its stdin carries the rank's settings and then serves as its lifeline; stdout and stderr are
    forwarded by the parent.
    """
    return subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def kill_group(proc: RankProcess, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` (default SIGKILL) to the process group that ``proc`` leads; gone is fine."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_words(code: int) -> str:
    """How a process ended, from its return code: ``exited with code 1``, ``was killed by ...``."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
