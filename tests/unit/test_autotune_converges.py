"""Autotune converges on a synthetic workload whose best fusion threshold is known.

A job of one over gloo in this process with ``HOROVOD_AUTOTUNE=1``; every step is a real
allreduce, but the tuner's clock is synthetic: each step advances it by the step's bytes divided
by a throughput that depends on the engine's current fusion threshold and peaks at 24 MiB. So
the best setting is known, and autotune's only view of it is bytes per second, as in training.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

import spark_estimators.collective as hvd
from spark_estimators import envvars as ev
from spark_estimators.collective.runtime import engine as eng

MIB = 1024 * 1024
BEST = 24 * MIB


def throughput(threshold: int) -> float:
    """Bytes per second of the synthetic workload: 1 GB/s at 24 MiB, 0.2 GB/s far from it."""
    return 1e9 * (0.2 + 0.8 * math.exp(-(((threshold - BEST) / (10 * MIB)) ** 2)))


@pytest.fixture
def tuned_job(monkeypatch, tmp_path):
    for name in (ev.SE_RANK, ev.SE_SIZE, ev.SE_BACKEND, ev.FUSION_THRESHOLD,
                 ev.HOROVOD_FUSION_THRESHOLD, ev.CYCLE_TIME, ev.HOROVOD_CYCLE_TIME):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE, "1")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_LOG, str(tmp_path / "tune.csv"))
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_WARMUP_SAMPLES, "2")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, "2")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES, "14")
    monkeypatch.setenv(ev.HOROVOD_CYCLE_TIME, "1")  # held: the search is over the threshold
    hvd.init(backend="gloo")
    try:
        yield tmp_path / "tune.csv"
    finally:
        hvd.shutdown()


def test_autotune_finds_the_known_best_threshold(tuned_job):
    engine = eng.current()
    tuner = engine.tuner
    assert tuner is not None and tuner.tuned == ("fusion_threshold",)
    now = [0.0]
    tuner.clock = lambda: now[0]
    grad = np.ones(1 << 16, dtype=np.float32)  # 256 KiB a step
    steps = 0
    while engine.tuner is not None and steps < 500:
        hvd.allreduce(grad, op=hvd.Sum)
        now[0] += grad.nbytes / throughput(engine.fusion_threshold)
        steps += 1
    assert engine.tuner is None, "autotune did not finish"
    chosen = engine.fusion_threshold
    assert abs(chosen - BEST) < 6 * MIB, chosen / MIB
    with open(tuned_job, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 + 14
    best = [r for r in rows if r["best"] == "1"]
    assert len(best) == 1 and int(best[0]["fusion_threshold_bytes"]) == chosen
    assert {r["cycle_time_ms"] for r in rows} == {"1.0"}
    # The score of a row is the synthetic throughput of its threshold (the clock is exact).
    for r in rows[2:]:
        expected = throughput(int(r["fusion_threshold_bytes"]))
        assert float(r["bytes_per_second"]) == pytest.approx(expected, rel=1e-3)
