"""A zygote: one process per executor that imports a rank's modules once and forks ranks.

The zygote is started by a PySpark worker with its environment, imports the modules a rank
needs before its first step (torch, the collective layer, pyarrow, ... see
:data:`spare.PREIMPORTS <spark_estimators.task.spare.PREIMPORTS>`), and then only waits for
requests on an abstract Unix socket named after the executor, the modules and the import-time
environment: every PySpark worker of the executor finds the same zygote, and it outlives the
worker that started it (PySpark ends idle workers after a minute; another job's tasks may end
theirs). For each rank, the Spark task connects and sends the rank's ends of four pipes (stdin,
stdout, stderr and an exit-status pipe, with ``SCM_RIGHTS``); the zygote forks a child that
takes them as its standard streams, and answers with the child's pid. The child never returns
to the zygote's loop: it reads the rank's settings from stdin and runs as that rank
(:func:`spark_estimators.task.spare.become_rank`), then exits. The zygote reaps it and writes its
exit code to the status pipe, which :class:`ForkedRank` reads: to the task, a forked rank looks
like a ``subprocess.Popen`` (``stdin``/``stdout``/``stderr``, ``poll``, ``wait``, ``pid``,
its own process group). Only a peer of the same user is served (``SO_PEERCRED``).

A fork costs a few milliseconds whatever the load, where a new interpreter importing torch costs
2-3 s of CPU: a later fit's ranks need no spare imported ahead on cycles the running fit leaves
(on 2 busy cores there are none). The zygote itself runs nothing but imports: no user code, no
CUDA, no process group, no thread of its own. A child gets fresh seeds (``random`` reseeds
itself after ``fork``; numpy's global generator is reseeded here) and torch's default seed, as a
new interpreter would. The zygote exits after its idle time without a request, or when the
executor's PySpark daemon (the workers' parent) ends.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import warnings
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

    Its exit code comes through the status pipe (the zygote, its parent, reaps it), read by a
    thread of its own, so ``poll`` and ``wait`` may be called from any thread (the task's main
    thread waits while its abort watcher polls). Should the zygote die first, the pipe ends
    without a code: the child is then waited for through a pidfd where the system has them, and
    its code reads as 1 ("exited without a result").
    """

    def __init__(
        self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], status_fd: int
    ) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(
            target=self._await_exit, args=(status_fd,), name=f"rank-{pid}-exit", daemon=True
        ).start()

    def _await_exit(self, status_fd: int) -> None:
        data = b""
        try:
            while len(data) < _CODE.size:
                chunk = os.read(status_fd, _CODE.size - len(data))
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(status_fd)
        if len(data) == _CODE.size:
            self.returncode = _CODE.unpack(data)[0]
        else:  # the zygote is gone before the child: wait for the child itself where we can
            self._wait_orphan()
            self.returncode = 1
        self._ended.set()

    def _wait_orphan(self) -> None:
        try:
            fd = _pidfd(self.pid)
        except OSError:
            return  # already gone
        if fd is None:
            return  # no pidfds here: nothing to wait on
        try:
            select.select([fd], [], [])  # readable once the child has ended
        finally:
            os.close(fd)

    def poll(self) -> int | None:
        """The exit code, or None while the rank runs."""
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end and return its exit code (``TimeoutExpired`` after timeout)."""
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank's process group (gone is fine)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def request_fork(address: str, timeout: float = REPLY_TIMEOUT_S) -> ForkedRank:
    """Ask the zygote listening at ``address`` for a child; :class:`ZygoteGone` if it cannot."""
    ours: list[int] = []
    theirs: list[int] = []
    for child_reads in (True, False, False, False):  # stdin, stdout, stderr, status
        r, w = os.pipe()
        ours.append(w if child_reads else r)
        theirs.append(r if child_reads else w)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            socket.send_fds(sock, [_FORK], theirs)
            reply = b""
            while len(reply) < _PID.size:
                chunk = sock.recv(_PID.size - len(reply))
                if not chunk:
                    raise ZygoteGone("the zygote closed the connection")
                reply += chunk
    except OSError as exc:  # refused (no zygote), timed out, reset
        for fd in ours:
            os.close(fd)
        raise ZygoteGone(f"no answer from the zygote: {exc}") from exc
    finally:
        for fd in theirs:
            os.close(fd)
    stdin = os.fdopen(ours[0], "wb")
    stdout, stderr = os.fdopen(ours[1], "rb"), os.fdopen(ours[2], "rb")
    return ForkedRank(_PID.unpack(reply)[0], stdin, stdout, stderr, ours[3])


def listen(address: str) -> socket.socket | None:
    """A listening socket bound to ``address``; None when a zygote already holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        return None
    sock.listen(16)
    return sock


def _same_user(conn: socket.socket) -> bool:
    """The peer runs as this process's user (``SO_PEERCRED``; True where that is missing)."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return True
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, peercred, 12))
    return uid == os.getuid()


def serve(
    listener: socket.socket,
    idle_s: float,
    become_rank: Callable[[], object],
    executor_pid: int | None = None,
) -> None:
    """The zygote's loop: fork a child per request, reap children, report their exit codes.

    Requests come from any PySpark worker of the executor (one connection each; a peer of
    another user is refused). Returns after ``idle_s`` seconds with neither a request nor a
    child, or when process ``executor_pid`` (the workers' parent) has ended. Single-threaded on
    purpose: ``fork`` copies only the calling thread, so the zygote holds no lock another
    thread could have taken.
    """
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signo, _frame: None)
    executor = _pidfd(executor_pid)
    status: dict[int, int] = {}  # child pid -> write end of its status pipe
    while True:
        waiting = [listener.fileno(), wake_r] + ([executor] if executor is not None else [])
        ready = select.select(waiting, [], [], None if status else idle_s)[0]
        if not ready or executor in ready:
            return  # idle, or the executor is gone (its ranks end on their own lifeline)
        if wake_r in ready:
            os.read(wake_r, 512)
        _reap(status)
        if listener.fileno() in ready:
            _answer(listener, status, [wake_r, wake_w], executor, become_rank)


def _pidfd(pid: int | None) -> int | None:
    """A pidfd of process ``pid`` (readable once it ends); None without ``pid`` or pidfds."""
    open_pidfd: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    if pid is None or open_pidfd is None:
        return None
    return open_pidfd(pid)  # ProcessLookupError: the process is already gone


def _answer(
    listener: socket.socket,
    status: dict[int, int],
    own: list[int],
    executor: int | None,
    become_rank: Callable[[], object],
) -> None:
    """Accept one request and fork its child (a malformed or foreign request is dropped)."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    with conn:
        fds: list[int] = []
        try:
            conn.settimeout(5.0)  # the client sends at once
            if not _same_user(conn):
                return
            msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)
        except OSError:
            msg = b""
        if msg != _FORK or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            return
        pid = _fork()
        if pid == 0:
            inherited = [listener.fileno(), conn.fileno(), *own, *status.values()]
            if executor is not None:
                inherited.append(executor)
            _child(fds, inherited, become_rank)
        for fd in fds[:3]:
            os.close(fd)
        status[pid] = fds[3]
        try:
            conn.sendall(_PID.pack(pid))
        except OSError:
            pass  # the task is gone: the child sees EOF on stdin and ends


def _fork() -> int:
    """``os.fork()``, without Python 3.12's warning about the threads of torch and jemalloc.

    Those idle helper threads hold no lock the child needs (the zygote itself runs no thread);
    the filter is restored in both processes, so the rank's own forks still warn.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
        return os.fork()


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
