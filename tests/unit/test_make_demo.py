"""``make demo`` installs only what the demo needs: the torch set, never TensorFlow (issue 27)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -W: act as if pyproject.toml changed, so the install steps are printed (not run: -n).
    out = subprocess.run(
        ["make", "-n", "-W", "pyproject.toml", target],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_make_demo_installs_the_torch_extra_only():
    commands = _dry_run("demo")
    installs = [line for line in commands.splitlines() if "pip install" in line and "-e" in line]
    assert installs == [installs[0]] and '-e ".[torch]"' in installs[0], commands
    assert "all," not in installs[0] and "tensorflow" not in commands, installs
    assert "spark_estimators.demo" in commands


def test_make_test_still_installs_every_extra():
    commands = _dry_run("test")
    assert '-e ".[all,dev]"' in commands, commands
