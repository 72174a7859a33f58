"""An executor's zygote as its PySpark workers use it (spark_estimators/task/spare.py).

Real processes: this test process plays a PySpark worker; its zygotes import light modules.
Each test uses its own module list, so each has its own zygote address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spark_estimators.task import spare

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets: Linux"),
]


@pytest.fixture
def worker(monkeypatch):
    """This process as a PySpark worker that started no zygote; kills what the test started."""
    monkeypatch.setattr(spare, "_started", [])
    monkeypatch.delenv(spare.SPARE_ENV, raising=False)
    yield spare._started
    for proc in spare._started:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("value", "expected"), [("", True), ("0", False), ("off", False), ("2", True), ("no", False)]
)
def test_the_setting_turns_the_zygote_on_and_off(monkeypatch, value, expected):
    monkeypatch.setenv(spare.SPARE_ENV, value)
    assert spare.enabled() is expected


def test_off_starts_no_zygote_and_forks_nothing(monkeypatch, worker):
    monkeypatch.setenv(spare.SPARE_ENV, "0")
    spare.ensure(("colorsys",))
    assert worker == []
    assert spare.take(("colorsys",), dict(os.environ)) is None


def _stdin_closed_exit(rank) -> tuple[int, bytes]:
    rank.stdin.close()  # no settings: the child says it needs a Spark task, exits 1
    return rank.wait(timeout=60), rank.stderr.read()


def test_one_zygote_serves_every_rank_of_its_environment(worker):
    modules = ("colorsys", "json")
    spare.ensure(modules)
    spare.ensure(modules)  # a second task or write of this executor: the same zygote
    assert len(worker) == 1
    env = spare._worker_env()
    ranks = [spare.take(modules, env) for _ in range(2)]
    assert all(r is not None for r in ranks)
    assert len({r.pid for r in ranks if r is not None}) == 2  # one fresh child per rank
    for rank in ranks:
        assert _stdin_closed_exit(rank)[0] == 1
    assert b"must be started by a Spark task" in _stdin_closed_exit(spare.take(modules, env))[1]
    # Another import-time environment or module list is not served: an ordinary process starts.
    assert spare.take(modules, {**env, "OMP_NUM_THREADS": "7"}) is None
    assert spare.take(("json",), env) is None
    assert len(worker) == 1


def _worker(script: str) -> list[str]:
    """Run ``script`` as a PySpark worker would: a child of this process (their executor)."""
    code = "from spark_estimators.task import spare\n" + textwrap.dedent(script)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_zygote_outlives_its_worker_and_serves_the_other_workers():
    """PySpark ends idle workers after a minute; the executor's zygote stays for the next fit."""
    modules = ("colorsys", "textwrap")
    (zygote_pid,) = _worker(f"spare.ensure({modules!r}); print(spare._started[0].pid)")
    try:
        started, parent, code = _worker(
            f"""
            spare.ensure({modules!r})  # the zygote is up: this worker starts none
            rank = spare.take({modules!r}, spare._worker_env())
            with open(f"/proc/{{rank.pid}}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            rank.stdin.close()
            print(len(spare._started), parent, rank.wait(timeout=60))
            """
        )
        assert (started, parent, code) == ("0", zygote_pid, "1")  # forked by the first's zygote
    finally:
        os.kill(int(zygote_pid), 9)


def test_a_dead_zygote_is_replaced(worker):
    modules = ("colorsys", "string")
    spare.ensure(modules)
    first = worker[0]
    first.kill()
    first.wait()
    assert spare.take(modules, spare._worker_env()) is None
    spare.ensure(modules)
    assert len(worker) == 1 and worker[0] is not first  # the dead one reaped, a new one up
    rank = spare.take(modules, spare._worker_env())
    assert rank is not None and _stdin_closed_exit(rank)[0] == 1
