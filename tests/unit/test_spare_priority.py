"""Spares import at SCHED_IDLE only where the worker can give them the normal policy back.

Linux treats ``SCHED_IDLE`` as nice 20: an unprivileged process may leave it only when its
``RLIMIT_NICE`` allows nice 0 (sched(7)), which the usual limit (0) does not. A spare idled where
that is refused would train, once adopted, on the cycles nobody else wants. Real processes and
the real kernel call here; the unprivileged case drops to ``nobody`` in a child (root only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spark_estimators.task import spare

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def _waiting_child() -> subprocess.Popen[bytes]:
    """A process that waits on its stdin until the test closes it."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )


def test_where_leaving_idle_is_allowed_a_spare_goes_idle_and_comes_back() -> None:
    if not spare.idle_allowed():
        pytest.skip("this user may not leave SCHED_IDLE (covered by the unprivileged test)")
    child = _waiting_child()
    try:
        assert spare.idle_priority(child.pid) is True
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
        assert spare.normal_priority(child.pid) is True
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
    finally:
        child.communicate(b"")


UNPRIVILEGED = textwrap.dedent(
    """
    import os, resource, subprocess
    from spark_estimators.task import spare  # before the drop: nobody cannot read root's Python

    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)  # nobody: no CAP_SYS_NICE, RLIMIT_NICE 0, as on most clusters
    allowed = spare.idle_allowed()
    child = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    idled = spare.idle_priority(child.pid)
    policy = os.sched_getscheduler(child.pid)
    child.communicate(b"")
    print(allowed, idled, policy == os.SCHED_OTHER)
    """
)


def test_an_unprivileged_worker_never_idles_a_spare_it_could_not_wake() -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping to an unprivileged user needs root")
    out = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={**os.environ, "HOME": "/tmp"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # not allowed; idle_priority refused to idle; the child kept the normal policy
    assert out.stdout.split() == ["False", "False", "True"]
