"""The harness itself: isolated hosts, teardown of a killed session, a loud failure without root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import netns
import pytest

pytestmark = pytest.mark.timeout(120)


def _in(cluster, host, *argv: str) -> str:
    proc = subprocess.run(
        cluster.argv(host, list(argv)), capture_output=True, text=True, timeout=30, check=True
    )
    return proc.stdout


def test_each_host_has_its_name_and_only_the_harness_network(cluster) -> None:
    for host in cluster.all_hosts:
        assert _in(cluster, host, "hostname").strip() == host.hostname
        addresses = _in(cluster, host, "ip", "-o", "-4", "addr").split("inet ")[1:]
        extra = {f"{cluster.service_address}/24"} if host is cluster.driver else set()
        assert {a.split()[0] for a in addresses} == {"127.0.0.1/8", f"{host.address}/24", *extra}
        # No default route: the only destinations are the harness's own /24 (and loopback).
        assert _in(cluster, host, "ip", "route").split() == [
            f"{netns.SUBNET}.0/24", "dev", "eth0", "proto", "kernel", "scope", "link",
            "src", host.address,
        ]  # fmt: skip
        hosts = _in(cluster, host, "getent", "hosts", cluster.hosts[2].hostname).split()
        assert hosts[0] == cluster.hosts[2].address


def test_namespaces_of_a_killed_session_are_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: the "killed pytest" owning the stale namespace
    stale, live = f"{netns.PREFIX}-{dead.pid}-host1", f"{netns.PREFIX}-{os.getpid()}-probe"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=20)
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
        workdir = Path(tempfile.gettempdir(), f"{netns.PREFIX}-{dead.pid}-stale")
        (workdir / "store").mkdir(parents=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"])
        swept = netns.sweep_stale()
        assert stale in swept and live not in swept
        assert sleeper.wait(timeout=20) == -9
        assert stale not in netns.namespaces() and not os.path.exists(f"/etc/netns/{stale}")
        assert live in netns.namespaces()
        assert not workdir.exists()
    finally:
        for name in (stale, live):
            netns.delete_namespace(name)


def test_without_root_the_harness_fails_loudly() -> None:
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run this check as another user")
    code = "import netns; netns.Cluster().create_network()"
    proc = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, cwd=Path(netns.__file__).parent,
        env={**os.environ, "PYTHONPATH": str(Path(netns.__file__).parent)},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "HarnessError" in proc.stderr and "needs root" in proc.stderr, proc.stderr[-2000:]
