"""The stock of spare rank processes of a PySpark worker (spark_estimators/task/spare.py).

Real processes: spares importing ``colorsys`` (a light module) in this test process, which
plays the PySpark worker.
"""

from __future__ import annotations

import os

import pytest

from spark_estimators.task import spare

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")

MODULES = ("colorsys",)


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def worker(monkeypatch):
    """This process as a PySpark worker with no spares; kills what the test leaves."""
    monkeypatch.setattr(spare, "_spares", [])
    yield spare._spares
    for sp in list(spare._spares):
        spare._discard(sp)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", spare.DEFAULT_STOCK), ("0", 0), ("off", 0), ("3", 3), ("7x", spare.DEFAULT_STOCK)],
)
def test_the_setting_is_the_number_of_spares_kept(monkeypatch, value, expected):
    monkeypatch.setenv(spare.SPARE_ENV, value)
    assert spare.stock() == expected
    assert spare.enabled() is (expected > 0)


def test_off_starts_no_spare_and_adopts_none(monkeypatch, worker):
    monkeypatch.setenv(spare.SPARE_ENV, "0")
    spare.ensure(MODULES)
    spare.ensure(MODULES, background=True)
    assert worker == []
    assert spare.take(MODULES, dict(os.environ)) is None


def test_the_stock_imports_at_idle_priority_and_an_adopted_spare_gets_the_normal_one(
    monkeypatch, worker
):
    monkeypatch.setenv(spare.SPARE_ENV, "2")
    spare.ensure(MODULES)  # a task starts: its rank takes the first one in a moment
    first, second = (sp.proc for sp in worker)
    assert _policies(first.pid) == {os.SCHED_OTHER}
    assert _policies(second.pid) == {os.SCHED_IDLE}  # for a later fit: leftover cycles only
    env = dict(os.environ)
    assert spare.take(MODULES, env) is first  # the oldest
    spare.ensure(MODULES, background=True)  # the rank trains: the stock is filled up again
    assert len(worker) == 2 and worker[0].proc is second
    assert _policies(worker[1].proc.pid) == {os.SCHED_IDLE}
    spare.ensure(MODULES)  # the rank ended: the next rank takes the oldest in a moment
    assert _policies(second.pid) == {os.SCHED_OTHER}
    assert _policies(worker[1].proc.pid) == {os.SCHED_IDLE}  # the one after it still waits
    assert spare.take(MODULES, env) is second
    assert _policies(second.pid) == {os.SCHED_OTHER}  # its rank runs at the normal priority
    # Another import-time environment cannot use a spare; the spare stays for later ranks.
    assert spare.take(MODULES, {**env, "OMP_NUM_THREADS": "7"}) is None
    assert len(worker) == 1
    third = worker[0].proc
    assert spare.take(MODULES, env) is third  # adopted while still idle: promoted by take
    assert _policies(third.pid) == {os.SCHED_OTHER}
    for proc in (first, second, third):
        proc.kill()
        proc.wait()
