"""The rank processes of a one-host job: environments, rendezvous port, PMI server, supervision.

What :mod:`spark_estimators.launch` starts (the local launcher and
:func:`~spark_estimators.launch.run_local`): one process per rank in its own session, its output
forwarded with a ``[rank]`` prefix, and, fail fast, SIGTERM then SIGKILL to the others' process
groups when one exits non-zero.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import IO, TYPE_CHECKING

from spark_estimators._base.ports import reserve_port, reserved_port
from spark_estimators._base.processes import kill_group

if TYPE_CHECKING:
    from spark_estimators.driver.launch_job import LaunchOptions
    from spark_estimators.driver.pmi import PMIServer

DEFAULT_GRACE_S = 5.0


@contextlib.contextmanager
def rendezvous_port(master_port: int | None) -> Iterator[int]:
    """``master_port`` when given, else a port this launcher holds until the ranks are done.

    Held, not probed and released: nothing else on the host can take it before rank 0's store
    binds it (see :mod:`spark_estimators._base.ports`).
    """
    if master_port:
        yield master_port
        return
    with reserve_port() as held:
        yield reserved_port(held)


def rank_envs(
    num_proc: int,
    backend: str = "auto",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    pmi: PMIServer | None = None,
) -> list[dict[str, str]]:
    """The variables of each rank of a one-host job (what the Spark launcher also sets).

    With a ``pmi`` server (backend mpi) each rank also gets the variables that make its
    ``MPI_Init`` join that server's job.
    """
    from spark_estimators.driver.service import RankSettings
    from spark_estimators.task.spark_task import rank_environment

    if not master_port:
        raise ValueError("rank_envs needs master_port (hold one with _base.ports.reserve_port)")
    port = master_port
    host = socket.gethostname()
    envs = []
    for rank in range(num_proc):
        settings = RankSettings(
            rank=rank,
            size=num_proc,
            local_rank=rank,
            local_size=num_proc,
            cross_rank=0,
            cross_size=1,
            master_addr=master_addr,
            master_port=port,
            host_hash=host,
        )
        env = rank_environment(settings, (), backend)
        if pmi is not None:
            env.update(pmi.rank_env(rank))
        envs.append(env)
    return envs


def launcher_env(extra: dict[str, str] | None, backend: str) -> dict[str, str]:
    """The launcher's environment plus ``extra``, without another process manager's PMI fd."""
    base = {**os.environ, **(extra or {})}
    if backend == "mpi":
        from spark_estimators.driver.pmi import FOREIGN_PMI_VARS

        for name in FOREIGN_PMI_VARS:
            base.pop(name, None)
    return base


def local_pmi_server(
    num_proc: int, backend: str
) -> contextlib.AbstractContextManager[PMIServer | None]:
    """A PMI server for an mpi job (every rank on this host), else nothing."""
    if backend != "mpi":
        return contextlib.nullcontext()
    from spark_estimators.driver.pmi import PMIServer, process_mapping

    return PMIServer(num_proc, "127.0.0.1", mapping=process_mapping(["localhost"] * num_proc))


def run_ranks(
    command: Sequence[str],
    options: LaunchOptions,
    *,
    master_port: int | None = None,
    fail_fast: bool = True,
    grace: float = DEFAULT_GRACE_S,
    stdin_lifeline: bool = False,
) -> Supervisor:
    """Run ``command`` as ranks ``0..options.num_proc-1`` on this host; the finished supervisor.

    What the local launcher and :func:`~spark_estimators.launch.run_local` share: each rank's
    variables (:func:`rank_envs` over ``options.env``), a rendezvous port held until the ranks
    are done, a PMI server for ``backend="mpi"``, and a :class:`Supervisor` run to the end
    (its ``codes``, ``first_failure`` and ``stopped`` say how each rank ended).
    """
    num_proc, backend = options.ranks, options.backend
    base = launcher_env(options.environment, backend)
    with local_pmi_server(num_proc, backend) as pmi, rendezvous_port(master_port) as port:
        envs = [
            {**base, **rank_env}
            for rank_env in rank_envs(num_proc, backend, "127.0.0.1", port, pmi)
        ]
        supervisor = Supervisor(
            [command] * num_proc,
            envs,
            options.stdout,
            options.stderr,
            timestamp=options.prefix_output_with_timestamp,
            fail_fast=fail_fast,
            grace=grace,
            stdin_lifeline=stdin_lifeline,
        )
        supervisor.run()
    return supervisor


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the rank when the launcher dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return preexec


class Supervisor:
    """Starts the rank processes, forwards their output, and stops all when one fails."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        stdout: IO[str] | None,
        stderr: IO[str] | None,
        timestamp: bool = False,
        fail_fast: bool = True,
        grace: float = DEFAULT_GRACE_S,
        stdin_lifeline: bool = False,
    ) -> None:
        self.commands, self.envs = commands, envs
        self.stdout, self.stderr = stdout, stderr
        self.timestamp, self.fail_fast, self.grace = timestamp, fail_fast, grace
        self.stdin_lifeline = stdin_lifeline
        self.procs: list[subprocess.Popen[bytes]] = []
        self.first_failure: int | None = None
        self.codes: dict[int, int] = {}  # rank -> exit code, once run() returned
        self.stopped: set[int] = set()  # ranks still running when the launcher stopped them
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def run(self) -> dict[int, int]:
        """Run every rank to the end; returns rank -> exit code."""
        exits: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        preexec = None if self.stdin_lifeline else _parent_death_signal()
        try:
            for command, env in zip(self.commands, self.envs):
                self.procs.append(
                    subprocess.Popen(
                        list(command),
                        env=env,
                        stdin=subprocess.PIPE if self.stdin_lifeline else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        preexec_fn=preexec,
                    )
                )
            readers = []
            for rank, proc in enumerate(self.procs):
                for pipe, is_err in ((proc.stdout, False), (proc.stderr, True)):
                    t = threading.Thread(
                        target=self._forward, args=(rank, pipe, is_err), daemon=True
                    )
                    t.start()
                    readers.append(t)
                threading.Thread(
                    target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True
                ).start()
            codes: dict[int, int] = {}
            while len(codes) < len(self.procs):
                rank, code = exits.get()
                codes[rank] = code
                if code != 0 and self.first_failure is None:
                    self.first_failure = rank
                    if self.fail_fast:
                        self._stop_all()
            for t in readers:
                t.join()
            self.codes = codes
            return codes
        except BaseException:
            self._kill_all(signal.SIGKILL)
            raise
        finally:
            self._stopping.set()
            self._kill_all(signal.SIGKILL)  # leave no grandchild behind
            for proc in self.procs:
                if proc.stdin is not None:
                    try:
                        proc.stdin.close()
                    except OSError:
                        pass

    def _forward(self, rank: int, pipe: IO[bytes] | None, is_err: bool) -> None:
        assert pipe is not None
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            stamp = ""
            if self.timestamp:
                stamp = " " + datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " "
            out = (self.stderr or sys.stderr) if is_err else (self.stdout or sys.stdout)
            with self._lock:
                out.write(f"[{rank}]{stamp}{line}\n")
                out.flush()
        pipe.close()

    def _stop_all(self) -> None:
        self.stopped = {r for r, p in enumerate(self.procs) if p.poll() is None}
        self._kill_all(signal.SIGTERM)

        def escalate() -> None:
            if not self._stopping.wait(self.grace):
                self._kill_all(signal.SIGKILL)

        threading.Thread(target=escalate, daemon=True).start()

    def _kill_all(self, sig: int) -> None:
        for proc in self.procs:
            kill_group(proc, sig)
