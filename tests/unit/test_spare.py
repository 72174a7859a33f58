"""A PySpark worker's zygote (spark_estimators/task/spare.py), with real processes.

This test process plays the PySpark worker; its zygote imports ``colorsys`` (a light module).
"""

from __future__ import annotations

import os

import pytest

from spark_estimators.task import spare

pytestmark = pytest.mark.timeout(120)

MODULES = ("colorsys",)


@pytest.fixture
def worker(monkeypatch):
    """This process as a PySpark worker with no zygote; kills what the test leaves."""
    monkeypatch.setattr(spare, "_zygotes", [])
    monkeypatch.delenv(spare.SPARE_ENV, raising=False)
    yield spare._zygotes
    for z in list(spare._zygotes):
        spare._discard(z)


@pytest.mark.parametrize(
    ("value", "expected"), [("", True), ("0", False), ("off", False), ("2", True), ("no", False)]
)
def test_the_setting_turns_the_zygote_on_and_off(monkeypatch, value, expected):
    monkeypatch.setenv(spare.SPARE_ENV, value)
    assert spare.enabled() is expected


def test_off_starts_no_zygote_and_forks_nothing(monkeypatch, worker):
    monkeypatch.setenv(spare.SPARE_ENV, "0")
    spare.ensure(MODULES)
    assert worker == []
    assert spare.take(MODULES, dict(os.environ)) is None


def test_one_zygote_serves_every_rank_of_its_environment(worker):
    spare.ensure(MODULES)
    spare.ensure(MODULES)  # a second task or write of this worker: the same zygote
    assert len(worker) == 1
    env = spare._worker_env()
    ranks = [spare.take(MODULES, env) for _ in range(2)]
    assert all(r is not None for r in ranks)
    assert len({r.pid for r in ranks if r is not None}) == 2  # one fresh child per rank
    for rank in ranks:
        assert rank is not None and rank.stdin is not None and rank.stderr is not None
        rank.stdin.close()  # no settings: the child says it needs a Spark task, exits 1
        assert rank.wait(timeout=60) == 1
        assert b"must be started by a Spark task" in rank.stderr.read()
    # Another import-time environment or module list is not served: an ordinary process starts.
    assert spare.take(MODULES, {**env, "OMP_NUM_THREADS": "7"}) is None
    assert spare.take(("json",), env) is None
    assert len(worker) == 1


def test_a_dead_zygote_is_replaced_and_never_forks(worker):
    spare.ensure(MODULES)
    first = worker[0]
    first.proc.kill()
    first.proc.wait()
    assert spare.take(MODULES, spare._worker_env()) is None
    spare.ensure(MODULES)
    assert len(worker) == 1 and worker[0] is not first and worker[0].proc.poll() is None


def test_a_worker_keeps_at_most_two_zygotes(worker, monkeypatch):
    for modules in (("colorsys",), ("json",), ("textwrap",)):
        spare.ensure(modules)
    assert [z.preimport for z in worker] == [("json",), ("textwrap",)]  # the oldest went
