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
its own process group).

Both ends check each other before anything is sent or forked (the host may be shared): the task
connects only to a zygote of its own user (``SO_PEERCRED`` of the listener) and sends nothing
else; the zygote serves only a peer of its own user that presents the zygote's key (a random
secret in a directory only our user can enter, see :mod:`spark_estimators.task.spare`), which also
names the address. A stranger who binds the address (abstract names are listed in
``/proc/net/unix``) gets no request and no config from us.

A forked rank writes its own exit code to the status pipe before it exits, and the zygote writes
it again when it reaps the child: a zygote that dies first (killed, out of memory) does not fail
the ranks it forked, which run on as orphans and report as usual.

A fork costs a few milliseconds whatever the load, where a new interpreter importing torch costs
2-3 s of CPU: a later fit's ranks need no spare imported ahead on cycles the running fit leaves
(on 2 busy cores there are none). The zygote itself runs nothing but imports: no user code, no
CUDA, no process group, no thread of its own. A child gets fresh seeds (``random`` reseeds
itself after ``fork``; numpy's global generator is reseeded here) and torch's default seed, as a
new interpreter would. The zygote exits after its idle time without a request, or when the
executor's PySpark daemon (the workers' parent) ends.
"""

from __future__ import annotations

import hmac
import logging
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

from spark_estimators._base.child import EXIT_CODE as _CODE
from spark_estimators._base.child import report_exit_code_to
from spark_estimators._base.owned import peer_credentials, peer_uid, same_user_peer

logger = logging.getLogger(__name__)

_PID = struct.Struct("!q")
#: The message that asks the zygote for a child (with four fds), followed by the zygote's key.
_FORK = b"F"
#: Bytes of the zygote's key (:func:`spark_estimators.task.spare.zygote_key`).
KEY_BYTES = 32
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
        self,
        pid: int,
        stdin: IO[bytes],
        stdout: IO[bytes],
        stderr: IO[bytes],
        status_fd: int,
        zygote_pid: int = 0,
    ) -> None:
        self.pid = pid
        self.zygote_pid = zygote_pid
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
        else:  # the child ended without its word and the zygote is gone: code unknown
            self._wait_orphan()
            logger.warning(
                "rank process %d ended without reporting its exit code, and the zygote (pid %d) "
                "that forked it had ended before it; counted as exit code 1",
                self.pid,
                self.zygote_pid,
            )
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


def request_fork(address: str, key: bytes, timeout: float = REPLY_TIMEOUT_S) -> ForkedRank:
    """Ask the zygote listening at ``address`` for a child; :class:`ZygoteGone` if it cannot.

    The listener must run as this user (``SO_PEERCRED``), else nothing is sent and
    :class:`ZygoteGone` says who holds the address; ``key`` proves to the zygote that the request
    is ours.
    """
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
            if not same_user_peer(sock):
                logger.warning(
                    "the zygote address is held by a process of user %s, not ours: not used",
                    peer_uid(sock),
                )
                raise ZygoteGone(f"the zygote address is held by user {peer_uid(sock)}")
            creds = peer_credentials(sock)
            zygote_pid = 0 if creds is None else creds[0]
            socket.send_fds(sock, [_FORK + key], theirs)
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
    return ForkedRank(_PID.unpack(reply)[0], stdin, stdout, stderr, ours[3], zygote_pid)


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


def serve(
    listener: socket.socket,
    idle_s: float,
    become_rank: Callable[[], object],
    executor_pid: int | None = None,
    *,
    key: bytes,
) -> None:
    """The zygote's loop: fork a child per request, reap children, report their exit codes.

    Requests come from any PySpark worker of the executor (one connection each; a peer of
    another user, or one without ``key``, is refused). Returns after ``idle_s`` seconds with
    neither a request nor a child, or when process ``executor_pid`` (the workers' parent) has
    ended. Single-threaded on
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
            _answer(listener, status, [wake_r, wake_w], executor, become_rank, key)


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
    key: bytes,
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
            if not same_user_peer(conn):
                return
            msg, fds, _flags, _addr = socket.recv_fds(conn, len(_FORK) + KEY_BYTES + 1, 4)
        except OSError:
            msg = b""
        if not hmac.compare_digest(msg, _FORK + key) or len(fds) != 4:
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
        os.set_inheritable(fds[3], False)  # the status pipe: this rank's, not its children's
        report_exit_code_to(fds[3])
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
