"""The stranger suite: another local user (``nobody``) attacks what our processes leave on the host.

Each attack runs as a real process of another uid (``runuser -u nobody``) with the system's
Python and only its standard library, as a stranger on a shared executor host would. It needs
root to switch users (CI runs as root); elsewhere the suite is skipped with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest

#: The stranger's interpreter: the system's (our venv may live where ``nobody`` cannot read).
STRANGER_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
STRANGER = "nobody"


def _check_can_switch() -> None:
    if os.geteuid() != 0:
        pytest.skip("the stranger suite switches to user 'nobody': it needs root (CI runs as root)")
    if shutil.which("runuser") is None:
        pytest.fail("runuser is missing: the stranger suite cannot run as another user")


def stranger_popen(code: str, *args: str) -> subprocess.Popen[str]:
    """Start ``code`` (Python, stdlib only) as user ``nobody``; its stdout is a text pipe."""
    _check_can_switch()
    return subprocess.Popen(
        ["runuser", "-u", STRANGER, "--", STRANGER_PYTHON, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def stranger_run(code: str, *args: str, timeout: float = 60) -> str:
    """Run ``code`` as ``nobody`` to its end; its stdout (stderr appended on failure)."""
    proc = stranger_popen(code, *args)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"the stranger's script failed:\n{err}"
    return out


def stranger_uid() -> int:
    """The uid of ``nobody``."""
    import pwd

    return pwd.getpwnam(STRANGER).pw_uid


@pytest.fixture
def stranger():
    """The helpers above, after checking that this session can switch users."""
    _check_can_switch()
    return stranger_popen
