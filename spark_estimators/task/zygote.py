"""A zygote: one process per PySpark worker that imports a rank's modules once and forks ranks.

The zygote is started with the worker's environment, imports the modules a rank needs before its
first step (torch, the collective layer, pyarrow, ... see :data:`spare.PREIMPORTS
<spark_estimators.task.spare.PREIMPORTS>`), and then only waits for requests on a Unix socket.
For each rank, the Spark task sends it the rank's ends of four pipes (stdin, stdout, stderr and
an exit-status pipe, with ``SCM_RIGHTS``); the zygote forks a child that takes them as its
standard streams, and answers with the child's pid. The child never returns to the zygote's
loop: it reads the rank's settings from stdin and runs as that rank
(:func:`spark_estimators.task.spare.become_rank`), then exits. The zygote reaps it and writes its
exit code to the status pipe, which :class:`ForkedRank` reads: to the task, a forked rank looks
like a ``subprocess.Popen`` (``stdin``/``stdout``/``stderr``, ``poll``, ``wait``, ``pid``,
its own process group).

A fork costs a few milliseconds whatever the load, where a new interpreter importing torch costs
2-3 s of CPU: a later fit's ranks need no spare imported ahead on cycles the running fit leaves
(on 2 busy cores there are none). The zygote itself runs nothing but imports: no user code, no
CUDA, no process group, no thread of its own. A child gets fresh seeds (``random`` reseeds
itself after ``fork``; numpy's global generator is reseeded here) and torch's default seed, as a
new interpreter would.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import IO, NoReturn

_PID = struct.Struct("!q")
_CODE = struct.Struct("!i")
#: The message that asks the zygote for a child (with four fds).
_FORK = b"F"
#: How long a task waits for the zygote's answer (it may still be importing).
REPLY_TIMEOUT_S = 120.0


class ZygoteGone(RuntimeError):
    """The zygote did not answer a fork request (dead, or past :data:`REPLY_TIMEOUT_S`)."""


class ForkedRank:
    """A rank process forked by the zygote, with the parts of ``subprocess.Popen`` a task uses.

    Its exit code comes through the status pipe (the zygote, its parent, reaps it). Should the
    zygote die first, the pipe ends without a code: the child is then waited for through a
    pidfd where the system has them, and its code reads as 1 ("exited without a result").
    """

    def __init__(
        self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], status_fd: int
    ) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._status_fd = status_fd
        self._pidfd: int | None = None

    def _read_status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        if self._pidfd is not None:  # orphaned: readable when the child has ended
            if not select.select([self._pidfd], [], [], timeout)[0]:
                return False
            os.close(self._pidfd)
            self._pidfd, self.returncode = None, 1
            return True
        if not select.select([self._status_fd], [], [], timeout)[0]:
            return False
        data = os.read(self._status_fd, _CODE.size)
        os.close(self._status_fd)
        if len(data) == _CODE.size:
            self.returncode = _CODE.unpack(data)[0]
            return True
        # The zygote is gone before the child: wait for the child itself where we can.
        open_pidfd: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
        try:
            self._pidfd = None if open_pidfd is None else open_pidfd(self.pid)
        except OSError:  # already gone
            self._pidfd = None
        if self._pidfd is None:
            self.returncode = 1
            return True
        return self._read_status(timeout)

    def poll(self) -> int | None:
        """The exit code, or None while the rank runs."""
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end and return its exit code (``TimeoutExpired`` after timeout)."""
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank's process group (gone is fine)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def request_fork(sock: socket.socket, timeout: float = REPLY_TIMEOUT_S) -> ForkedRank:
    """Ask the zygote behind ``sock`` for a child; raises :class:`ZygoteGone` when it cannot."""
    ours: list[int] = []
    theirs: list[int] = []
    for child_reads in (True, False, False, False):  # stdin, stdout, stderr, status
        r, w = os.pipe()
        ours.append(w if child_reads else r)
        theirs.append(r if child_reads else w)
    try:
        socket.send_fds(sock, [_FORK], theirs)
        sock.settimeout(timeout)
        reply = b""
        while len(reply) < _PID.size:
            chunk = sock.recv(_PID.size - len(reply))
            if not chunk:
                raise ZygoteGone("the zygote closed its socket")
            reply += chunk
    except OSError as exc:  # socket.timeout included
        for fd in ours:
            os.close(fd)
        raise ZygoteGone(f"no answer from the zygote: {exc}") from exc
    finally:
        for fd in theirs:
            os.close(fd)
    stdin = os.fdopen(ours[0], "wb")
    stdout, stderr = os.fdopen(ours[1], "rb"), os.fdopen(ours[2], "rb")
    return ForkedRank(_PID.unpack(reply)[0], stdin, stdout, stderr, ours[3])


def serve(sock: socket.socket, idle_s: float, become_rank: Callable[[], object]) -> None:
    """The zygote's loop: fork a child per request, reap children, report their exit codes.

    Returns when the worker closed its end and no child is left, or after ``idle_s`` seconds
    with neither a request nor a child. Single-threaded on purpose: ``fork`` copies only the
    calling thread, so the zygote holds no lock another thread could have taken.
    """
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signo, _frame: None)
    status: dict[int, int] = {}  # child pid -> write end of its status pipe
    open_socket = True
    while open_socket or status:
        waiting = [wake_r] + ([sock] if open_socket else [])
        ready = select.select(waiting, [], [], None if status else idle_s)[0]
        if not ready:
            return  # idle: nobody asked for a rank in idle_s
        if wake_r in ready:
            os.read(wake_r, 512)
        _reap(status)
        if sock in ready:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 4)
            except OSError:
                msg, fds = b"", []
            if msg != _FORK or len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                open_socket = False  # the worker is gone (EOF) or speaks no protocol we know
                continue
            pid = os.fork()
            if pid == 0:
                _child(fds, [sock.fileno(), wake_r, wake_w, *status.values()], become_rank)
            for fd in fds[:3]:
                os.close(fd)
            status[pid] = fds[3]
            sock.sendall(_PID.pack(pid))


def _reap(status: dict[int, int]) -> None:
    while status:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, _CODE.pack(os.waitstatus_to_exitcode(raw)))
            except OSError:
                pass  # the task is gone
            os.close(fd)


def _child(fds: list[int], inherited: list[int], become_rank: Callable[[], object]) -> NoReturn:
    """In the forked child: take the rank's streams, drop the zygote's state, become the rank."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own process group, as a plain rank (start_new_session)
        for fd in inherited:
            os.close(fd)
        os.close(fds[3])  # the status pipe is the zygote's
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        if "numpy" in sys.modules:  # `random` reseeds itself after fork; numpy's does not
            sys.modules["numpy"].random.seed()
        become_rank()
    except BaseException:  # noqa: BLE001 - never return into the zygote's loop
        import traceback

        traceback.print_exc()
    os._exit(1)
