"""Two run() jobs at once, several rounds: each meets only its own ranks on its own port.

The flake this guards against (two concurrent jobs, gloo's join "Connection reset by peer")
came from a rendezvous port probed and released before rank 0 bound it; the deterministic
checks are in tests/unit/test_rendezvous_port.py and tests/integration/test_run_rendezvous_port.py.
"""

from __future__ import annotations

import pytest
from faultlib import run_script

pytest.importorskip("torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.spark,
    pytest.mark.multiprocess,
    pytest.mark.timeout(600),
]

ROUNDS = 4


def test_concurrent_run_jobs_each_meet_their_own_ranks():
    out, _ = run_script("concurrent_runs.py", str(ROUNDS), timeout=560)
    assert out["errors"] == []
    assert len(out["rounds"]) == ROUNDS
    for results in out["rounds"]:
        assert sorted(results) == ["a", "b"]
        for ranks in results.values():
            assert [r["rank"] for r in ranks] == [0, 1]
            assert [r["sum"] for r in ranks] == [3.0, 3.0]
            assert len({r["port"] for r in ranks}) == 1
        assert results["a"][0]["port"] != results["b"][0]["port"]
