"""Several "hosts" on one machine: network namespaces on one bridge, a Spark standalone cluster.

The harness of ``make test-multihost`` (docs/clusters.md, "Testing across hosts: network
namespaces"). It needs root and iproute2's ``ip``; where it cannot create namespaces it raises
:class:`HarnessError` (the tests fail, they never skip).

Layout (``<id>`` is the pytest process's pid, so concurrent sessions never share names)::

    semh-<id>-br      the bridge namespace: bridge br0 and one port per host
    semh-<id>-driver  10.213.7.10  hostname semh-driver   the Spark driver (driver_agent.py)
    semh-<id>-host1   10.213.7.11  hostname semh-host1    Master + Worker (2 cores)
    semh-<id>-host2   10.213.7.12  hostname semh-host2    Worker (2 cores)
    semh-<id>-host3   10.213.7.13  hostname semh-host3    Worker (2 cores)

Each host namespace has ``lo`` up and ``eth0``, one end of a veth pair whose other end (named
after the host) is a port of the bridge. No link touches the machine's own namespace, so no
packet of the harness can leave it, and nothing outside it can reach the cluster. Every
process starts through ``ip netns exec <ns> unshare --uts``: ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` (written here: every harness host's name and address) over
``/etc/hosts``, and the UTS namespace gives the process its host's name, so
``socket.gethostname()`` (the host hash), Gloo's address lookup and Spark's
``SPARK_LOCAL_HOSTNAME`` all see a host of their own.

Teardown (:meth:`Cluster.close`, also from ``atexit``): every process group the harness
started gets SIGTERM then SIGKILL; every process still inside one of its namespaces (``ip netns
pids``: the executors' rank processes run in sessions of their own) gets SIGKILL; then the
namespaces (their links go with them) and ``/etc/netns/<ns>`` are deleted. :func:`sweep_stale`
does the same at start for namespaces of a harness whose pytest process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

PREFIX = "semh"
SUBNET = "10.213.7"
MASTER_PORT = 7077
CORES_PER_HOST = 2
REPO = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("driver_agent.py")
SPARK_HOME = Path(pyspark.__file__).parent
#: Marks every process the harness starts (and their children): the leak checks look for it.
SESSION_VAR = "SEMH_SESSION"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\w+$")


class HarnessError(RuntimeError):
    """The harness could not build or drive its hosts (not root, no ``ip``, a server died)."""


@dataclass(frozen=True)
class Host:
    """One namespace of the harness."""

    name: str  # host1, host2, host3, driver
    netns: str
    hostname: str
    address: str


def _ip(*args: str, check: bool = True, timeout: float = 20) -> str:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def require_tools() -> None:
    """Raise :class:`HarnessError` unless this process can create network namespaces."""
    missing = [tool for tool in ("ip", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        raise HarnessError(
            f"the multi-host harness needs {missing} on PATH (apt-get install -y iproute2 "
            "util-linux hostname); .ci/run installs them"
        )
    if os.geteuid() != 0:
        raise HarnessError(
            f"the multi-host harness creates network namespaces and needs root (euid "
            f"{os.geteuid()}); run make test-multihost as root, as CI does"
        )


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(netns: str) -> list[int]:
    """SIGKILL every process inside ``netns``; returns their pids."""
    pids = [int(p) for p in _ip("netns", "pids", netns, check=False).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def delete_namespace(netns: str) -> None:
    """Kill what runs in ``netns``, delete it (its links go with it) and its /etc/netns dir."""
    if netns in namespaces():
        kill_namespace_processes(netns)
        _ip("netns", "delete", netns, check=False)
    shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir("/etc/netns")  # only when no other namespace keeps files there


def sweep_stale() -> list[str]:
    """Delete harness namespaces and work dirs whose pytest process is gone (a killed run)."""
    swept = []
    names = set(namespaces())
    if os.path.isdir("/etc/netns"):
        names.update(os.listdir("/etc/netns"))
    for name in sorted(names):
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            delete_namespace(name)
            swept.append(name)
    # Work directories (logs, store) of sessions that could not clean up after themselves.
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-*"):
        owner = folder.name.split("-")[1]
        if folder.is_dir() and owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
    return swept


class Cluster:
    """Three hosts and a driver host on one bridge, a Spark standalone cluster across them."""

    def __init__(self, workdir: str | None = None) -> None:
        self.id = os.getpid()
        base = f"{PREFIX}-{self.id}"
        self.bridge = f"{base}-br"
        self.hosts = [
            Host(f"host{i}", f"{base}-host{i}", f"{PREFIX}-host{i}", f"{SUBNET}.{10 + i}")
            for i in (1, 2, 3)
        ]
        self.driver = Host("driver", f"{base}-driver", f"{PREFIX}-driver", f"{SUBNET}.10")
        self.master_url = f"spark://{self.hosts[0].address}:{MASTER_PORT}"
        #: A second address of the driver host, for our driver service only (driver_host=):
        #: a host can lose it while Spark's own traffic to the driver still flows.
        self.service_address = f"{SUBNET}.20"
        self.workdir = workdir or ""  # made by create_network, once the tools are there
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self._closed = False
        self.env = dict(
            os.environ,
            SPARK_HOME=str(SPARK_HOME),
            SPARK_DAEMON_MEMORY="256m",
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
            PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            **{SESSION_VAR: str(self.id)},
        )
        for name in ("SPARK_LOCAL_IP", "SPARK_LOCAL_HOSTNAME", "SPARK_ESTIMATORS_DRIVER_HOST"):
            self.env.pop(name, None)

    @property
    def all_hosts(self) -> list[Host]:
        return [*self.hosts, self.driver]

    def host_of(self, address: str) -> Host:
        return next(h for h in self.all_hosts if h.address == address)

    # -- network --------------------------------------------------------------------------
    def create_network(self) -> None:
        """The bridge namespace, one namespace per host with lo, eth0 and /etc/netns hosts."""
        require_tools()
        sweep_stale()
        self.workdir = self.workdir or tempfile.mkdtemp(prefix=f"{PREFIX}-{self.id}-")
        self.env["SPARK_LOG_DIR"] = self.workdir
        atexit.register(self.close)
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.hostname}\n" for h in self.all_hosts
        )
        for host in self.all_hosts:
            _ip("netns", "add", host.netns)
            os.makedirs(f"/etc/netns/{host.netns}", exist_ok=True)
            Path(f"/etc/netns/{host.netns}/hosts").write_text(hosts_file)
            # Both ends are created inside their namespaces: nothing in the machine's own.
            _ip(
                "link", "add", "eth0", "netns", host.netns, "type", "veth",
                "peer", "name", host.name, "netns", self.bridge,
            )  # fmt: skip
            _ip("-n", self.bridge, "link", "set", host.name, "master", "br0")
            _ip("-n", self.bridge, "link", "set", host.name, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", self.driver.netns, "addr", "add", f"{self.service_address}/24", "dev", "eth0")

    def set_link(self, host: Host, up: bool) -> None:
        """Cut ``host`` off the bridge (its bridge port down) or connect it again."""
        _ip("-n", self.bridge, "link", "set", host.name, "up" if up else "down")

    def drop_traffic(self, host: Host, address: str, drop: bool) -> None:
        """Make ``host`` lose every packet it sends to ``address`` (a silent firewall), or not.

        A permanent neighbour entry sends the packets to a MAC address nobody has: connects
        from ``host`` time out, as behind a dropping firewall; other hosts are not affected.
        """
        if drop:
            _ip("-n", host.netns, "neigh", "replace", address, "lladdr", "02:00:00:00:00:01",
                "dev", "eth0", "nud", "permanent")  # fmt: skip
        else:
            _ip("-n", host.netns, "neigh", "del", address, "dev", "eth0", check=False)

    # -- processes ------------------------------------------------------------------------
    def argv(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``: its network namespace, /etc/hosts and hostname."""
        return [
            "ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname, *argv,
        ]  # fmt: skip

    def start(
        self, key: str, host: Host, argv: list[str], env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host`` in a process group of its own, output to ``<key>.log``."""
        log = open(os.path.join(self.workdir, key + ".log"), "ab")  # noqa: SIM115
        self._logs.append(log)
        proc = subprocess.Popen(
            self.argv(host, argv),
            env={**self.env, "SPARK_LOCAL_IP": host.address,
                 "SPARK_LOCAL_HOSTNAME": host.hostname, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kw,
        )  # fmt: skip
        self.procs[key] = proc
        return proc

    def log_tail(self, key: str, chars: int = 3000) -> str:
        try:
            return Path(self.workdir, key + ".log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_size(self, key: str) -> int:
        try:
            return Path(self.workdir, key + ".log").stat().st_size
        except OSError:
            return 0

    def wait_for_log(self, key: str, text: str, timeout: float, since: int = 0) -> None:
        """Poll ``<key>.log`` (a server's own output) until ``text`` appears past byte ``since``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(self.workdir, key + ".log"), "rb") as f:
                    f.seek(since)
                    if text.encode() in f.read():
                        return
            except OSError:
                pass
            if self.procs[key].poll() is not None:
                break
            time.sleep(0.5)  # watching another process's log file, no own thread to join
        raise HarnessError(f"{key}: no {text!r} within {timeout}s:\n{self.log_tail(key)}")

    def spark_class(self, *args: str) -> list[str]:
        return [str(SPARK_HOME / "bin" / "spark-class"), *args]

    def start_master(self) -> None:
        host = self.hosts[0]
        self.start(
            "master",
            host,
            self.spark_class(
                "org.apache.spark.deploy.master.Master",
                "--host", host.address, "--port", str(MASTER_PORT), "--webui-port", "8080",
            ),
        )  # fmt: skip

    def start_worker(self, host: Host) -> None:
        key = f"worker-{host.name}"
        work = os.path.join(self.workdir, key)
        os.makedirs(work, exist_ok=True)
        self.start(
            key,
            host,
            self.spark_class(
                "org.apache.spark.deploy.worker.Worker",
                "--host", host.address, "--cores", str(CORES_PER_HOST), "--memory", "3g",
                "--webui-port", "8081", "--work-dir", work, self.master_url,
            ),
        )  # fmt: skip

    def start_spark(self, timeout: float = 180) -> None:
        """Master on host1, one Worker per host; returns once every Worker has registered."""
        self.start_master()
        self.wait_for_log("master", "I have been elected leader", timeout)
        for host in self.hosts:
            self.start_worker(host)
        for host in self.hosts:
            self.wait_for_log(f"worker-{host.name}", "Successfully registered with master", timeout)

    def worker_alive(self, host: Host) -> bool:
        proc = self.procs.get(f"worker-{host.name}")
        return proc is not None and proc.poll() is None

    def restart_worker(self, host: Host, timeout: float = 180) -> None:
        """Start ``host``'s Worker again (after a fault test killed it) and wait until it has
        registered; the Master then starts the driver's missing executor on it."""
        key = f"worker-{host.name}"
        self.stop(key, grace=5)
        since = self.log_size(key)
        self.start_worker(host)
        self.wait_for_log(key, "Successfully registered with master", timeout, since=since)

    def stop(self, key: str, grace: float = 10) -> None:
        """SIGTERM the process group of ``key``, SIGKILL it after ``grace`` seconds."""
        proc = self.procs.pop(key, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def processes_in(self, host: Host) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", host.netns, check=False).split()]

    def close(self) -> None:
        """Stop every process, delete every namespace and link, remove the work directory."""
        if self._closed:
            return
        self._closed = True
        for key in list(self.procs):
            self.stop(key, grace=5)
        for host in self.all_hosts:
            delete_namespace(host.netns)
        delete_namespace(self.bridge)
        for log in self._logs:
            log.close()
        if not os.environ.get("SEMH_KEEP_WORKDIR"):
            shutil.rmtree(self.workdir, ignore_errors=True)


class DriverAgent:
    """The Spark driver in the driver host: one SparkSession, scenarios run on request.

    The agent (driver_agent.py) reads one JSON request per line on stdin and answers one JSON
    line on a pipe of its own (the JVM writes to stdout and stderr, which go to a log).
    """

    def __init__(
        self,
        cluster: Cluster,
        key: str = "driver",
        conf: dict[str, str] | None = None,
        executors: int | None = None,
    ):
        """``executors``: how many executors (one per host, 2 cores each) the session asks for
        and waits for; all three hosts' by default."""
        self.cluster, self.key = cluster, key
        read_fd, write_fd = os.pipe()
        config = {
            "master": cluster.master_url,
            "driver": cluster.driver.address,
            "workdir": cluster.workdir,
            "executors": executors or len(cluster.hosts),
            "cores": CORES_PER_HOST,
            "conf": conf or {},
            "result_fd": write_fd,
        }
        self.proc = cluster.start(
            key,
            cluster.driver,
            [sys.executable, str(AGENT)],
            env={"SEMH_AGENT": json.dumps(config)},
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "rb")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._answers, selectors.EVENT_READ)
        self._pending = False
        self.ready = self._read(timeout=240)

    def send(self, scenario: str, **kwargs: Any) -> None:
        assert self.proc.stdin is not None and not self._pending
        self.proc.stdin.write(
            (json.dumps({"scenario": scenario, "kwargs": kwargs}) + "\n").encode()
        )
        self.proc.stdin.flush()
        self._pending = True

    def receive(self, timeout: float) -> dict[str, Any]:
        self._pending = False
        return self._read(timeout)

    def call(self, scenario: str, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
        """Run ``scenario`` in the agent; its JSON answer (``error`` set when it raised)."""
        self.send(scenario, **kwargs)
        return self.receive(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._selector.select(timeout=min(1.0, deadline - time.monotonic())):
                line = self._answers.readline()
                if not line:
                    break
                return dict(json.loads(line))
            if self.proc.poll() is not None:
                break
        raise HarnessError(
            f"driver agent: no answer within {timeout}s (exit {self.proc.poll()}):\n"
            + self.cluster.log_tail(self.key, 6000)
        )

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the agent stops its session and exits on EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.cluster.stop(self.key, grace=5)
        self._selector.close()
        self._answers.close()
