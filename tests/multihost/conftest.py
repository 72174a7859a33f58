"""Multi-host suite: three hosts in network namespaces, a Spark standalone cluster across them.

Runs in a pytest process of its own (``make test-multihost``, or any pytest command line naming a
path inside ``tests/multihost``); a pytest run over the whole repository (``make test``) skips
this directory. The harness (netns.py) needs root and iproute2: without them every test fails
with :class:`netns.HarnessError`, none is skipped (a skipped test fails the run). One cluster and
one driver (a SparkSession in the driver host) serve the whole session; the fault tests run last
(test_faults_*, files run in name order) as they cut a host off or kill one. A test after them
that needs all three executors takes the ``whole_cluster`` fixture.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent.resolve()
sys.path.insert(0, str(HERE))

import netns  # noqa: E402


def _selected(config: pytest.Config) -> bool:
    """Whether the command line names this directory or a path inside it."""
    base = Path(config.invocation_params.dir)
    for arg in config.invocation_params.args:
        arg = str(arg)
        if arg.startswith("-"):
            continue
        path = (base / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return None if _selected(config) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.multihost)
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(scope="session")
def cluster() -> Iterator[netns.Cluster]:
    """Three hosts with a Worker each (Master on host1) and an empty driver host."""
    # SIGTERM (a CI timeout) becomes KeyboardInterrupt, so the finalizers below still run.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    harness = netns.Cluster()
    try:
        harness.create_network()
        harness.start_spark()
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="session")
def agent(cluster: netns.Cluster) -> Iterator[netns.DriverAgent]:
    """A SparkSession in the driver host with the three executors registered."""
    driver = netns.DriverAgent(cluster)
    try:
        yield driver
    finally:
        driver.close()


@pytest.fixture
def whole_cluster(cluster: netns.Cluster, agent: netns.DriverAgent) -> netns.Cluster:
    """The cluster with its three Workers and the agent's three executors, whatever an earlier
    fault test killed: dead Workers are started again, then the executors are waited for."""
    for host in cluster.hosts:
        if not cluster.worker_alive(host):
            cluster.restart_worker(host)
    answer = agent.call("executors", timeout=200, count=len(cluster.hosts), wait_s=180)
    assert "error" not in answer, answer.get("tb")
    assert sorted(answer["hosts"]) == sorted(h.address for h in cluster.hosts), answer
    return cluster


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped multi-host test fails the run: the harness must never pass by skipping."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if _selected(session.config) and skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line(f"tests/multihost: {len(skipped)} test(s) skipped: failing the run")
