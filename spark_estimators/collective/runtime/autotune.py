"""Autotune (Horovod's ``--autotune``, ``HOROVOD_AUTOTUNE=1``): tune the knobs while training.

What is tuned: the fusion threshold (0 .. 64 MiB), the cycle time (0 .. 10 ms) and, when the
ranks span hosts with several ranks on one (:mod:`..backends.hierarchical`), hierarchical
allreduce and allgather on/off. A knob the user set (``HOROVOD_FUSION_THRESHOLD`` or ours,
``HOROVOD_CYCLE_TIME`` or ours, ``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``_ALLGATHER``, also to 0) is
held constant. There is no response cache here, so Horovod's cache capacity is not a knob.

How: rank 0 measures *bytes allreduced per second* over samples of
``HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE`` steps (default 10). A step ends when a negotiation round
empties rank 0's queue (the end of a burst of gradient allreduces, or a blocking op); the sample
spans the wall time from its first round to the start of the step after its last, compute
included, so it scores training throughput. The first ``HOROVOD_AUTOTUNE_WARMUP_SAMPLES``
samples (default 3) run the starting settings and are discarded. Then the starting settings are
scored, and each next setting comes from a Bayesian optimiser (:mod:`.bayes`, noise
``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE``, default 0.8) until
``HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` (default 20) settings were scored; the best one, as
it ran, is kept for the rest of the job and the tuner detaches. (The optimiser sees each knob
scaled to ``[0, 1]`` over its range; a starting value outside it, such as the default 128 MiB
threshold, counts as the nearest end.)

All ranks switch at the same op: rank 0 writes the settings it decided into its negotiation
vector (header fields ``TUNE*`` of :mod:`.negotiation`), every rank reads them from the same
gathered vectors and applies them in that round, joined ranks included. No extra collective.

The log (``HOROVOD_AUTOTUNE_LOG`` / ``--autotune-log-file``, written by rank 0 after every sample)
is a CSV with a header and one row per sample: ``sample, warmup, fusion_threshold_bytes,
cycle_time_ms, hierarchical_allreduce, hierarchical_allgather, steps, bytes, seconds,
bytes_per_second, best``; ``best`` is 1 on the best scored row so far (the one kept at the end).
Only the global set's engine is tuned (process sets keep the settings they started with).
"""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from spark_estimators import envvars as ev
from spark_estimators.collective.backends.base import DTYPES
from spark_estimators.collective.backends.hierarchical import HierarchicalBackend
from spark_estimators.collective.runtime import negotiation as neg
from spark_estimators.collective.runtime import settings
from spark_estimators.collective.runtime.bayes import BayesianOptimizer
from spark_estimators.collective.runtime.engine import Engine
from spark_estimators.collective.runtime.requests import Kind
from spark_estimators.errors import ConfigurationError

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
#: Ranges of the continuous knobs: fusion threshold (bytes) and cycle time (milliseconds).
FUSION_RANGE = (0, 64 * MIB)
CYCLE_RANGE_MS = (0.0, 10.0)
_FLAG_ALLREDUCE, _FLAG_ALLGATHER, _FLAG_FINAL = 1, 2, 4
LOG_COLUMNS = (
    "sample", "warmup", "fusion_threshold_bytes", "cycle_time_ms", "hierarchical_allreduce",
    "hierarchical_allgather", "steps", "bytes", "seconds", "bytes_per_second", "best",
)  # fmt: skip


@dataclass(frozen=True)
class Params:
    """Horovod's autotune parameters (environment variables, defaults as Horovod's)."""

    warmup_samples: int = 3
    steps_per_sample: int = 10
    max_samples: int = 20
    noise: float = 0.8
    log: str | None = None

    @staticmethod
    def from_env() -> Params:
        """Read ``HOROVOD_AUTOTUNE_*``; a ConfigurationError names a bad variable."""

        def number(name: str, default: float, low: float, cast: type) -> float:
            try:
                value = cast(ev.env_float(name, default))
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
            if value < low or (cast is int and value != ev.env_float(name, default)):
                kind = "an integer " if cast is int else ""
                raw = os.environ.get(name)
                raise ConfigurationError(f"{name}={raw!r} must be {kind}>= {low:g}")
            return float(value)

        return Params(
            warmup_samples=int(number(ev.HOROVOD_AUTOTUNE_WARMUP_SAMPLES, 3, 0, int)),
            steps_per_sample=int(number(ev.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE, 10, 1, int)),
            max_samples=int(number(ev.HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES, 20, 1, int)),
            noise=number(ev.HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, 0.8, 0.0, float),
            log=os.environ.get(ev.HOROVOD_AUTOTUNE_LOG, "").strip() or None,
        )


@dataclass(frozen=True)
class Setting:
    """One combination of the knobs."""

    fusion_threshold: int
    cycle_time_ms: float
    hierarchical_allreduce: bool
    hierarchical_allgather: bool


class Autotune:
    """The engine's tuner (:class:`~.requests.Tuner`); see the module docstring.

    ``tuned`` names the knobs to tune (of ``fusion_threshold``, ``cycle_time_ms``,
    ``hierarchical_allreduce``, ``hierarchical_allgather``); the others keep ``start``'s value.
    """

    def __init__(self, rank: int, start: Setting, tuned: tuple[str, ...], params: Params) -> None:
        self.rank, self.params, self.tuned = rank, params, tuned
        #: Seconds of a monotonic clock (tests give a synthetic one).
        self.clock: Callable[[], float] = time.perf_counter
        self.current = start
        self.start_setting = start
        self.rows: list[dict[str, object]] = []
        self._scored: list[tuple[float, Setting]] = []
        self._optimizer = BayesianOptimizer(max(len(tuned), 1), noise=params.noise)
        self._version = self._applied = 0
        self._final = False
        self._measuring = rank == 0  # rank 0 measures the starting settings right away
        self._t0: float | None = None  # set by the first round measured
        self._bytes = self._steps = 0
        self._emptied = False
        self._next: Setting | None = None
        self.done = False

    # -- the engine's hooks --------------------------------------------------------------------
    def stamp(self, vector: np.ndarray) -> np.ndarray:
        """Rank 0 publishes the latest decided setting (and its version) in its vector."""
        if self.rank == 0 and self._version:
            s = self._next or self.current
            flags = _FLAG_ALLREDUCE * s.hierarchical_allreduce
            flags += _FLAG_ALLGATHER * s.hierarchical_allgather + _FLAG_FINAL * self._final
            vector[neg.TUNE], vector[neg.TUNE_FUSION] = self._version, s.fusion_threshold
            vector[neg.TUNE_CYCLE_US] = round(s.cycle_time_ms * 1000)
            vector[neg.TUNE_FLAGS] = flags
        return vector

    def settle(self, engine: object, vectors: np.ndarray) -> None:
        """Apply a newly published setting (every rank); measure and decide (rank 0)."""
        assert isinstance(engine, Engine)
        row = vectors[0]
        version = int(row[neg.TUNE])
        if version > self._applied:
            self._applied = version
            flags = int(row[neg.TUNE_FLAGS])
            self.current = Setting(
                int(row[neg.TUNE_FUSION]),
                int(row[neg.TUNE_CYCLE_US]) / 1000,
                bool(flags & _FLAG_ALLREDUCE),
                bool(flags & _FLAG_ALLGATHER),
            )
            apply(engine, self.current)
            self._next = None
            if flags & _FLAG_FINAL:
                engine.tuner = None
                self.done = True
                return
            if self.rank == 0:
                self._measuring, self._t0 = True, self.clock()
                self._bytes = self._steps = 0
                self._emptied = False
        if self.rank != 0 or not self._measuring:
            return
        if self._t0 is None:
            self._t0 = self.clock()
        active = [r for r in range(vectors.shape[0]) if vectors[r, neg.JOINED] < 0]
        count = nbytes = 0
        if active and int(vectors[active[0], neg.KIND]) == int(Kind.ALLREDUCE):
            plan = engine._negotiation.plan(vectors, active)  # the same plan the engine runs
            dtype = DTYPES[int(vectors[active[0], neg.DTYPE])]
            nbytes, count = plan.numel * neg.itemsize(dtype), plan.count
        if self._emptied:  # this round starts a step
            self._steps += 1
            if self._steps >= self.params.steps_per_sample:
                self._close_sample()
                return
        self._bytes += nbytes
        self._emptied = len(engine._backlog) <= max(count, 1)  # this round empties the queue

    # -- rank 0's decisions ------------------------------------------------------------------------
    def _close_sample(self) -> None:
        seconds = max(self.clock() - (self._t0 or 0.0), 1e-9)
        score = self._bytes / seconds
        warmup = len(self.rows) < self.params.warmup_samples
        s = self.current
        self.rows.append({
            "sample": len(self.rows), "warmup": int(warmup),
            "fusion_threshold_bytes": s.fusion_threshold, "cycle_time_ms": s.cycle_time_ms,
            "hierarchical_allreduce": int(s.hierarchical_allreduce),
            "hierarchical_allgather": int(s.hierarchical_allgather), "steps": self._steps,
            "bytes": self._bytes, "seconds": round(seconds, 6), "bytes_per_second": round(score),
            "best": 0,
        })  # fmt: skip
        if not warmup:
            self._optimizer.observe(self._encode(s), score)
        scored = [r for r in self.rows if not r["warmup"]]
        if scored:
            best = max(scored, key=lambda r: float(r["bytes_per_second"]))  # type: ignore[arg-type]
            for r in self.rows:
                r["best"] = int(r is best)
        self._write_log()
        self._measuring = False
        if not warmup:
            self._scored.append((score, s))
        if len(scored) >= self.params.max_samples:
            # The best setting as it ran (not decoded from the optimiser's clipped point).
            self._next, self._final = max(self._scored, key=lambda pair: pair[0])[1], True
            logger.info("autotune done after %d samples: %s", len(self.rows), self._next)
        elif warmup and len(self.rows) < self.params.warmup_samples:
            self._next = s
        elif not scored:
            self._next = self.start_setting  # the first scored sample: the starting settings
        else:
            self._next = self._decode(self._optimizer.suggest())
        self._version += 1

    def _encode(self, s: Setting) -> list[float]:
        values = {
            "fusion_threshold": _unit(s.fusion_threshold, FUSION_RANGE),
            "cycle_time_ms": _unit(s.cycle_time_ms, CYCLE_RANGE_MS),
            "hierarchical_allreduce": float(s.hierarchical_allreduce),
            "hierarchical_allgather": float(s.hierarchical_allgather),
        }
        return [values[k] for k in self.tuned] or [0.0]

    def _decode(self, point: np.ndarray) -> Setting:
        base = self.start_setting
        values = dict(zip(self.tuned, (float(p) for p in point), strict=False))
        fusion, cycle = base.fusion_threshold, base.cycle_time_ms
        if "fusion_threshold" in values:
            fusion = int(_scale(values["fusion_threshold"], FUSION_RANGE)) // 1024 * 1024
        if "cycle_time_ms" in values:
            cycle = round(_scale(values["cycle_time_ms"], CYCLE_RANGE_MS), 3)
        allreduce = values.get("hierarchical_allreduce")
        allgather = values.get("hierarchical_allgather")
        return Setting(
            fusion,
            cycle,
            base.hierarchical_allreduce if allreduce is None else allreduce > 0.5,
            base.hierarchical_allgather if allgather is None else allgather > 0.5,
        )

    def _write_log(self) -> None:
        if not self.params.log:
            return
        tmp = self.params.log + ".tmp"
        with open(tmp, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=LOG_COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.params.log)


def _unit(value: float, bounds: tuple[float, float]) -> float:
    return (value - bounds[0]) / (bounds[1] - bounds[0])


def _scale(unit: float, bounds: tuple[float, float]) -> float:
    return bounds[0] + unit * (bounds[1] - bounds[0])


def apply(engine: Engine, setting: Setting) -> None:
    """Make ``engine`` (and its backend's hierarchical switches, if any) use ``setting``."""
    engine.fusion_threshold = int(setting.fusion_threshold)
    engine.cycle_time = setting.cycle_time_ms / 1000.0
    backend = engine.backend
    if isinstance(backend, HierarchicalBackend):
        backend.allreduce_on = setting.hierarchical_allreduce
        backend.allgather_on = setting.hierarchical_allgather


def from_env(engine: Engine) -> Autotune:
    """The tuner for ``engine`` as the environment asks (call when ``HOROVOD_AUTOTUNE`` is on)."""
    params = Params.from_env()
    backend = engine.backend
    hierarchical = isinstance(backend, HierarchicalBackend)
    allreduce, allgather = settings.hierarchical()
    start = Setting(
        engine.fusion_threshold,
        engine.cycle_time * 1000.0,
        bool(getattr(backend, "allreduce_on", False)),
        bool(getattr(backend, "allgather_on", False)),
    )
    tuned = []
    if ev.first_set(ev.FUSION_THRESHOLD, ev.HOROVOD_FUSION_THRESHOLD) is None:
        tuned.append("fusion_threshold")
    if ev.first_set(ev.CYCLE_TIME, ev.HOROVOD_CYCLE_TIME) is None:
        tuned.append("cycle_time_ms")
    if hierarchical and allreduce is None:
        tuned.append("hierarchical_allreduce")
    if hierarchical and allgather is None:
        tuned.append("hierarchical_allgather")
    return Autotune(backend.rank, start, tuple(tuned), params)


__all__ = ["Autotune", "Params", "Setting", "apply", "from_env"]
