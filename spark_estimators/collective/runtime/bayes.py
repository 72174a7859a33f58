"""A small Bayesian optimiser for autotune: a Gaussian process and expected improvement, numpy only.

Our dependency set has no optimisation library (no scipy, no scikit-learn), and autotune needs
little: a handful of parameters scaled to ``[0, 1]``, at most a few dozen samples. So:

* :class:`GaussianProcess`: zero-mean GP regression with a squared-exponential (RBF) kernel of
  one length scale, observation noise ``alpha`` added to the kernel's diagonal (Horovod's
  ``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE``, default 0.8), targets standardised (mean 0,
  standard deviation 1) before fitting, solved with a Cholesky factorisation.
* :class:`BayesianOptimizer`: proposes the point of largest expected improvement over the best
  observation among random candidates (a seeded generator: the same observations give the same
  proposal), plus the observed points' neighbours, so the search both explores and refines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_ERF = np.frompyfunc(math.erf, 1, 1)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.asarray(_ERF(z / math.sqrt(2.0)), dtype=np.float64))


def _normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


class GaussianProcess:
    """GP regression on points of ``[0, 1]^d`` (see the module docstring)."""

    def __init__(self, length_scale: float = 0.25, alpha: float = 0.8) -> None:
        if length_scale <= 0 or alpha < 0:
            raise ValueError(f"length_scale={length_scale} must be > 0 and alpha={alpha} >= 0")
        self.length_scale, self.alpha = float(length_scale), float(alpha)
        self._x: np.ndarray = np.zeros((0, 0))
        self._chol: np.ndarray = np.zeros((0, 0))
        self._weights: np.ndarray = np.zeros(0)
        self._mean, self._scale = 0.0, 1.0

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
        return np.exp(-0.5 * d2 / self.length_scale**2)

    def fit(self, x: np.ndarray, y: np.ndarray) -> GaussianProcess:
        """Condition on observations ``y`` at points ``x`` (shape ``(n, d)``)."""
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        self._mean = float(y.mean())
        spread = float(y.std())
        self._scale = spread if spread > 0 else 1.0
        k = self._kernel(x, x) + (self.alpha + 1e-9) * np.eye(len(x))
        self._chol = np.linalg.cholesky(k)
        target = (y - self._mean) / self._scale
        self._weights = np.linalg.solve(self._chol.T, np.linalg.solve(self._chol, target))
        self._x = x
        return self

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the (noise-free) function at points ``x``."""
        x = np.asarray(x, dtype=np.float64)
        ks = self._kernel(x, self._x)
        mean = ks @ self._weights
        v = np.linalg.solve(self._chol, ks.T)
        var = np.clip(1.0 - (v * v).sum(axis=0), 1e-12, None)
        return mean * self._scale + self._mean, np.sqrt(var) * self._scale


def expected_improvement(
    mean: np.ndarray, std: np.ndarray, best: float, xi: float = 0.01
) -> np.ndarray:
    """Expected improvement over ``best`` (maximisation) of normal predictions."""
    gain = mean - best - xi
    z = gain / std
    return np.asarray(gain * _normal_cdf(z) + std * _normal_pdf(z))


class BayesianOptimizer:
    """Maximises a noisy function of ``dims`` parameters in ``[0, 1]`` (module docstring)."""

    def __init__(
        self, dims: int, noise: float = 0.8, seed: int = 0, candidates: int = 2000
    ) -> None:
        if dims < 1:
            raise ValueError(f"dims={dims} must be >= 1")
        self.dims, self.noise, self.candidates = dims, float(noise), int(candidates)
        self._rng = np.random.default_rng(seed)
        self.points: list[np.ndarray] = []
        self.values: list[float] = []

    def observe(self, point: Sequence[float], value: float) -> None:
        """Record the function's ``value`` at ``point``."""
        self.points.append(np.clip(np.asarray(point, dtype=np.float64), 0.0, 1.0))
        self.values.append(float(value))

    def suggest(self) -> np.ndarray:
        """The next point to try: random at first, then the largest expected improvement."""
        if len(self.points) < 2:
            return np.asarray(self._rng.random(self.dims))
        x, y = np.stack(self.points), np.asarray(self.values)
        gp = GaussianProcess(alpha=self.noise).fit(x, y)
        near = x[:, None, :] + self._rng.normal(0.0, 0.05, size=(len(x), 20, self.dims))
        pool = np.concatenate(
            [self._rng.random((self.candidates, self.dims)), near.reshape(-1, self.dims)]
        )
        pool = np.clip(pool, 0.0, 1.0)
        mean, std = gp.predict(pool)
        best = float(gp.predict(x)[0].max())
        return np.asarray(pool[int(np.argmax(expected_improvement(mean, std, best)))])

    def best(self) -> tuple[np.ndarray, float]:
        """The observed point with the largest value, and that value."""
        i = int(np.argmax(self.values))
        return self.points[i], self.values[i]


__all__ = ["BayesianOptimizer", "GaussianProcess", "expected_improvement"]
