"""The numpy Gaussian process and Bayesian optimiser behind autotune, and its parameters."""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators import envvars as ev
from spark_estimators.collective.runtime import autotune
from spark_estimators.collective.runtime.bayes import (
    BayesianOptimizer,
    GaussianProcess,
    expected_improvement,
)
from spark_estimators.errors import ConfigurationError


def test_gp_interpolates_with_little_noise_and_is_unsure_far_away():
    x = np.array([[0.1], [0.4], [0.9]])
    y = np.array([1.0, 3.0, 2.0])
    gp = GaussianProcess(length_scale=0.2, alpha=1e-6).fit(x, y)
    mean, std = gp.predict(x)
    np.testing.assert_allclose(mean, y, atol=1e-4)
    assert std.max() < 1e-2
    _, far = gp.predict(np.array([[0.65]]))
    assert far[0] > 10 * std.max()


def test_expected_improvement_prefers_high_mean_then_high_uncertainty():
    ei = expected_improvement(np.array([1.0, 2.0, 1.0]), np.array([0.1, 0.1, 1.0]), best=1.5)
    assert ei[1] > ei[0] and ei[2] > ei[0]


@pytest.mark.parametrize("noise", [0.01, 0.8])
def test_optimizer_finds_the_maximum_of_a_known_function(noise):
    target = np.array([0.7, 0.2])

    def f(p: np.ndarray) -> float:
        return float(10.0 - 20.0 * ((p - target) ** 2).sum())

    opt = BayesianOptimizer(2, noise=noise, seed=3)
    for _ in range(25):
        p = opt.suggest()
        opt.observe(p, f(p))
    point, value = opt.best()
    assert np.abs(point - target).max() < 0.12
    assert value > f(target) - 0.3
    # Random search with as many samples does worse on average (the optimiser is not luck).
    rng = np.random.default_rng(3)
    assert value >= np.mean([max(f(rng.random(2)) for _ in range(25)) for _ in range(20)])


def test_autotune_parameters_follow_horovod(monkeypatch):
    for name in (ev.HOROVOD_AUTOTUNE_WARMUP_SAMPLES, ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE,
                 ev.HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
                 ev.HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, ev.HOROVOD_AUTOTUNE_LOG):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert autotune.Params.from_env() == autotune.Params(3, 10, 20, 0.8, None)
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, "20")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, "0.75")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_LOG, "/tmp/log.csv")
    assert autotune.Params.from_env() == autotune.Params(3, 20, 20, 0.75, "/tmp/log.csv")
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, "0")
    with pytest.raises(ConfigurationError, match="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE='0' must be"):
        autotune.Params.from_env()
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, "2.5")
    with pytest.raises(ConfigurationError, match="must be an integer"):
        autotune.Params.from_env()
    monkeypatch.setenv(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, "many")
    with pytest.raises(ConfigurationError, match="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE='many'"):
        autotune.Params.from_env()
