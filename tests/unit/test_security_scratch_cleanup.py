"""Issue 27 item 12: ``se-rank-*`` scratch dirs of killed tasks do not pile up in /tmp.

Real processes stand for the Spark task: one is SIGKILLed while its scratch dir exists (as
when an executor is killed), one exits without removing it. Before the fix both dirs stayed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spark_estimators.task.scratch import create_scratch, remove_scratch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

_TASK = r"""
import os, sys
from spark_estimators.task.scratch import create_scratch, remove_at_rank_exit
env = {"TMPDIR": sys.argv[1]}
path = create_scratch(env)
os.environ["SPARK_ESTIMATORS_RANK_SCRATCH"] = path
fixed = os.path.join(sys.argv[1], "fixed-" + os.path.basename(path))
os.makedirs(fixed)
remove_at_rank_exit(fixed)     # a path the rank registered outside its scratch dir
print(path, flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()           # killed here
"""


def _task(base: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _TASK, base, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_scratch_of_a_killed_task_is_removed_at_the_next_start(tmp_path):
    base = str(tmp_path)
    killed = _task(base, "wait")
    living = _task(base, "wait")
    try:
        dead_dir = killed.stdout.readline().strip()
        live_dir = living.stdout.readline().strip()
        assert os.path.isdir(dead_dir) and os.path.isdir(live_dir)
        killed.kill()
        killed.wait(30)
        legacy = tmp_path / "se-rank-legacy"  # made by an earlier version: no owner recorded
        legacy.mkdir()
        env = {"TMPDIR": base}
        mine = create_scratch(env)  # the next task on this host
        try:
            left = sorted(os.listdir(base))
            assert os.path.basename(dead_dir) not in left
            assert "fixed-" + os.path.basename(dead_dir) not in left  # its registered path too
            assert os.path.basename(live_dir) in left  # its task still runs
            assert "se-rank-legacy" in left
            assert os.path.basename(mine) in left
        finally:
            remove_scratch(mine)
    finally:
        for proc in (killed, living):
            proc.kill()
            proc.wait()


def test_scratch_is_removed_when_the_task_process_exits(tmp_path):
    proc = _task(str(tmp_path), "exit")
    path = proc.stdout.readline().strip()
    assert proc.wait(30) == 0
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert os.listdir(tmp_path) == []
