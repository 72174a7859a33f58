"""Elastic: kill one of 2 ranks at a random step; the job recovers, counts every sample exactly
``EPOCHS`` times (none dropped, none twice), converges; ``reset_limit`` stops a job whose rank
keeps dying. Runs in its own local[2,4] session (4 attempts per task), see scripts/elastic_kill.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from faultlib import run_script

pytest.importorskip("torch")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(600)]

EPOCHS, N, STEPS = 4, 384, 48  # as in scripts/elastic_kill.py (12 steps per epoch, 2 ranks)
TRUE_W = [1.5, -2.0, 0.5]
RECOVERY_BOUND_S = 60  # kill -> training again on a new round (Spark retry + new process)
JOB_BOUND_S = 540  # the whole script, JVM start and both scenarios included


def test_killed_rank_is_replaced_and_no_sample_is_lost_or_repeated():
    kill_step = random.Random().randint(2, STEPS - 2)
    out, elapsed = run_script("elastic_kill.py", str(kill_step), timeout=JOB_BOUND_S)
    assert elapsed < JOB_BOUND_S
    kill = out["kill"]
    assert kill["killed_at"] is not None, "rank 1 was never killed"
    results = kill["results"]
    # Spark retried the killed task and the job grew back to 2 ranks.
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["size"] for r in results} == {2}
    survivor = results[0]
    assert survivor["resets"], f"kill at step {kill_step}: rank 0 never reset"
    recovered_at = survivor["resets"][0][1]
    assert recovered_at - kill["killed_at"] < RECOVERY_BOUND_S
    # Nothing lost, nothing twice: every sample counted exactly EPOCHS times, on every rank.
    for r in results:
        assert r["steps"] == STEPS
        assert len(r["seen"]) == N
        assert set(r["seen"]) == {EPOCHS}, f"kill at step {kill_step}: counts {set(r['seen'])}"
    # The ranks hold the same model, and it converged.
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    np.testing.assert_allclose(results[0]["weights"], TRUE_W, atol=0.1)
    assert results[0]["mse"] < 0.01

    limited = out["reset_limit"]
    assert limited["error"] == "ElasticResetLimitError"
    assert "reset_limit=1 reached" in limited["message"]
    assert limited["failures"] >= 2 and "SIGKILL" in limited["message"]
