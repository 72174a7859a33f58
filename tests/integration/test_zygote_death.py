"""A zygote killed in the middle of a fit does not fail the ranks it forked (issue 40).

Before, the task read a forked rank's exit code only from the zygote; a killed zygote made every
healthy rank read as "exited with code 1 without reporting a result" and the fit failed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from spark_estimators import run  # noqa: E402
from spark_estimators.task import spare  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _kill_my_zygote(meeting: str) -> tuple[int, bool]:
    """Once both ranks run, kill the zygote that forked them, wait until orphaned, finish."""
    import os
    import signal
    import sys
    import time

    rank = int(os.environ["RANK"])
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        forked = b"spark_estimators.task.spare_process" in f.read()
    open(os.path.join(meeting, f"{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(meeting)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # both ranks forked before the zygote goes
    if forked:
        try:
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the other rank killed it first
        deadline = time.monotonic() + 60
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.01)  # the kernel reparents us once the zygote is gone
    return rank, forked and "torch" in sys.modules


def test_ranks_forked_by_a_zygote_that_is_killed_still_succeed(spark, tmp_path):
    fn = spare.with_preimports(_kill_my_zygote, "torch")
    for attempt in ("first", "second"):  # the second fit starts a new zygote
        meeting = tmp_path / attempt
        meeting.mkdir()
        results = run(fn, args=(str(meeting),), num_proc=2, spark=spark, verbose=0)
        assert [rank for rank, _ in results] == [0, 1]
        assert all(forked for _, forked in results)  # they really were the zygote's children
