"""Two fits at once in one SparkSession, different run_ids: no collision of data,
checkpoints or ports (in a subprocess with its own local[4] session, 2 ranks per fit)."""

from __future__ import annotations

import numpy as np
import pytest
from faultlib import run_script

pytest.importorskip("torch")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(420)]

BOUND_S = 400  # both fits, JVM start included, on a loaded 2-core machine


def test_two_concurrent_fits_do_not_collide():
    out, elapsed = run_script("concurrent_fits.py", timeout=BOUND_S)
    assert elapsed < BOUND_S
    assert out["errors"] == {}
    weights = {"fit_a": [1.0, 2.0, -3.0], "fit_b": [-2.0, 0.5, 4.0]}
    for run_id, true_w in weights.items():
        fit = out[run_id]
        # Data: each model learned its own DataFrame (the other's weights are far away).
        np.testing.assert_allclose(fit["weights"], true_w, atol=0.15)
        # Checkpoints: each run's checkpoint holds exactly its own final weights and epochs.
        np.testing.assert_allclose(fit["checkpoint_weights"], fit["weights"], rtol=0, atol=0)
        assert fit["checkpoint_epoch"] == 5
        assert fit["history_epochs"] == fit["info_epochs"] == list(range(6))
        assert len(fit["master_ports"]) == 1 and len(fit["driver_ports"]) == 1
    # Ports: each fit had its own rendezvous point and its own driver service.
    assert out["fit_a"]["master_ports"] != out["fit_b"]["master_ports"]
    assert out["fit_a"]["driver_ports"] != out["fit_b"]["driver_ports"]
    assert len(out["datasets"]) == 2  # two prepared datasets, one per DataFrame
