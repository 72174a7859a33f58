"""Autotune (HOROVOD_AUTOTUNE=1) in 2 real rank processes: switching, constants, the log.

Each step allreduces 64 small tensors (4 KiB each) one by one with ``allreduce_async_`` and
waits for them; results are checked at every step while the settings change under them. The
cycle time is set by hand (``HOROVOD_CYCLE_TIME``), so autotune must hold it. The tests read the
CSV log and what each rank ended with. (Convergence to a known best setting is tested in one
process with a synthetic clock: tests/unit/test_autotune_converges.py.)
"""

from __future__ import annotations

import csv

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

TENSORS, NUMEL = 64, 1024
STEP_BYTES = TENSORS * NUMEL * 4


def _train(max_steps: int) -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.collective.runtime import engine as eng

    hvd.init()
    engine = eng.current()
    grads = [torch.full((NUMEL,), float(i)) for i in range(TENSORS)]
    steps = 0
    ok = True
    while engine.tuner is not None and steps < max_steps:
        handles = [hvd.allreduce_async_(g, op=hvd.Sum) for g in grads]
        for h in handles:
            hvd.synchronize(h)
        for i, g in enumerate(grads):
            ok = ok and bool((g == i * 2 ** (steps + 1)).all())
        steps += 1
    out = {
        "steps": steps,
        "done": engine.tuner is None,
        "fusion_threshold": engine.fusion_threshold,
        "cycle_time_ms": engine.cycle_time * 1000,
        "values_ok": ok,
    }
    hvd.shutdown()
    return out


def test_autotune_converges_holds_constants_and_writes_the_log(tmp_path):
    log = tmp_path / "autotune.csv"
    env = {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(log),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6",
        "HOROVOD_CYCLE_TIME": "2.5",  # held constant
    }
    results = run_local(_train, num_proc=2, args=(400,), env=env, backend="gloo")
    assert all(r["done"] for r in results), results
    assert all(r["values_ok"] for r in results)
    assert results[0]["steps"] == results[1]["steps"] < 400
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["sample"]) for r in rows] == list(range(7))
    assert [int(r["warmup"]) for r in rows] == [1] + [0] * 6
    assert {float(r["cycle_time_ms"]) for r in rows} == {2.5}  # the constant was held
    assert {r["hierarchical_allreduce"] for r in rows} == {"0"}  # one host: not a knob
    # Warm-up, then the starting setting (the default threshold, 128 MiB) is scored first.
    assert int(rows[0]["fusion_threshold_bytes"]) == int(rows[1]["fusion_threshold_bytes"])
    assert int(rows[1]["fusion_threshold_bytes"]) == 128 * 1024 * 1024
    assert len({r["fusion_threshold_bytes"] for r in rows}) > 2  # it tried other thresholds
    scored = rows[1:]
    best = [r for r in rows if r["best"] == "1"]
    assert len(best) == 1 and best[0] in scored
    assert float(best[0]["bytes_per_second"]) == max(float(r["bytes_per_second"]) for r in scored)
    for r in scored:
        # A step ends when a round empties rank 0's queue (a loaded machine may end one early).
        assert int(r["steps"]) == 3 and int(r["bytes"]) >= STEP_BYTES // 2
        assert int(r["bytes"]) % (NUMEL * 4) == 0  # whole tensors
    # Every rank ends on the best row's setting, at the same step.
    for r in results:
        assert r["fusion_threshold"] == int(best[0]["fusion_threshold_bytes"])
        assert r["cycle_time_ms"] == pytest.approx(2.5)
