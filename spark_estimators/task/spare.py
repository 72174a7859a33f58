"""Spare rank processes: a fresh rank process started ahead of time with the framework imported.

Where a fit's time goes (bench/startup.py, 2 cores): ``import torch`` alone takes 1-7 s of a
rank's start (the more, the busier the machine), more than the Parquet write of a 100k-row
dataset. The rank cannot start while ``prepare_data`` writes on a cluster whose slots are all
needed by the training stage (barrier mode runs only when all ``num_proc`` tasks have a slot, and
the write job needs slots too), so the import is moved off the critical path instead:

- each ``prepare_data`` write task starts a **spare** in its PySpark worker (its imports then
  overlap the write; the training stage's tasks mostly run in the same workers next), the
  Spark task of an estimator's training stage starts one as its first act if its worker has
  none (the imports then overlap the registration of all ranks), and starts one again when its
  rank has ended, for the next fit that this PySpark worker runs (a CrossValidator's next fold,
  a notebook's re-run);
- the next rank of that worker **adopts** the spare instead of starting a process: the spare
  receives the rank's whole environment and settings on stdin and becomes an ordinary rank
  process (:mod:`spark_estimators.task.child`).

A spare is still a fresh process in the sense of DECISIONS ("Where a rank runs"): it has run
nothing but ``import`` of the listed modules, never user code, and it serves exactly one rank,
then exits. A rank process is never reused. A spare is not adopted (it is killed and an ordinary
process starts) when the rank's environment differs from the spare's in a variable read at
import time (``OMP_*``, ``MKL_*``, ``CUDA_*``, ``TORCH*``, ``PYTHON*``, ``LD_*``, ... see
:data:`IMPORT_TIME_PREFIXES`): e.g. ``env={"OMP_NUM_THREADS": "1"}`` always gets a process
started with it.

Only the estimators ask for spares (their training function carries
``__spark_estimators_preimport__``, e.g. ``("torch",)``); ``run(fn)`` starts plain processes.
A spare waits at most ``SPARK_ESTIMATORS_SPARE_RANK_IDLE_S`` seconds (default 600) and exits
with its PySpark worker (stdin EOF); ``SPARK_ESTIMATORS_SPARE_RANKS=0`` (executor environment,
e.g. ``spark.executorEnv.SPARK_ESTIMATORS_SPARE_RANKS``) turns spares off. Cost: one idle
process per PySpark worker that ran a training task, ~200-300 MB RSS with torch imported.
``data="stream"`` ranks inherit a pipe from their task and always start as plain processes.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from spark_estimators._base.processes import kill_group

SPARE_ENV = "SPARK_ESTIMATORS_SPARE_RANKS"
IDLE_ENV = "SPARK_ESTIMATORS_SPARE_RANK_IDLE_S"
DEFAULT_IDLE_S = 600.0
#: The attribute of a rank function naming the modules a spare imports ahead (a tuple of names).
PREIMPORT_ATTR = "__spark_estimators_preimport__"
#: Environment variables read when a module is imported: a spare started without the rank's
#: values for these is not adopted.
IMPORT_TIME_PREFIXES = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "LD_",
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL_",
    "HIP_",
    "ROCR_",
    "TF_",
    "KERAS",
    "XLA_",
    "SPARK_ESTIMATORS_LAZY_DYNAMO",
)


@dataclass
class Spare:
    """One spare process of this PySpark worker, with the environment it was started with."""

    proc: subprocess.Popen[bytes]
    preimport: tuple[str, ...]
    env: dict[str, str]


_lock = threading.Lock()
_spare: Spare | None = None


#: Modules the estimators' spare rank processes import, by framework.
PREIMPORTS = {"torch": ("torch",), "lightning": ("torch",)}


def with_preimports(trainer: Callable[..., Any], framework: str) -> Callable[..., Any]:
    """``trainer`` marked with the modules its spare rank processes import ahead."""
    marked = partial(trainer)
    setattr(marked, PREIMPORT_ATTR, PREIMPORTS.get(framework, ()))
    return marked


def enabled() -> bool:
    """False when ``SPARK_ESTIMATORS_SPARE_RANKS=0`` in this (executor) process."""
    return os.environ.get(SPARE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def preimports(fn: object) -> tuple[str, ...]:
    """The modules ``fn`` wants imported in a spare (its ``__spark_estimators_preimport__``)."""
    names = getattr(fn, PREIMPORT_ATTR, ())
    return tuple(str(n) for n in names) if isinstance(names, tuple | list) else ()


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a module may read while it is imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def _idle_s() -> float:
    try:
        return float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    except ValueError:
        return DEFAULT_IDLE_S


def _discard(spare: Spare | None) -> None:
    if spare is not None:
        kill_group(spare.proc)
        spare.proc.wait()


def ensure(preimport: tuple[str, ...]) -> None:
    """Have one live spare with ``preimport`` imported in this worker (start it if needed)."""
    global _spare
    if not preimport or not enabled():
        return
    with _lock:
        old = _spare
        if old is not None and old.proc.poll() is None and old.preimport == preimport:
            return
        _spare = None
        _discard(old)
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # as every rank process (see rank_environment)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spark_estimators.task.spare_process",
                str(_idle_s()),
                *preimport,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        _spare = Spare(proc, preimport, env)


def take(preimport: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """The spare of this worker for a rank with environment ``env``; None: start a plain one.

    A spare that exited, imported other modules, or was started with other import-time variables
    (see :data:`IMPORT_TIME_PREFIXES`) is killed and None is returned.
    """
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    usable = (
        preimport
        and spare.preimport == preimport
        and spare.proc.poll() is None
        and import_time_env(spare.env) == import_time_env(env)
    )
    if not usable:
        _discard(spare)
        return None
    return spare.proc


def main() -> None:
    """The spare process: import, wait for a rank's config, then run as that rank."""
    idle_s, names = float(sys.argv[1]), sys.argv[2:]
    import importlib

    from spark_estimators.task import lazy_dynamo

    lazy_dynamo.install()  # as a plain rank: before torch, so eager training never loads dynamo
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank's own import will report it
            pass
    stdin = sys.stdin.buffer
    ready, _, _ = select.select([stdin], [], [], idle_s)
    if not ready or not getattr(stdin, "peek", lambda _n: b"x")(1):  # idle, or worker gone
        os._exit(0)
    from spark_estimators._base.child import read_config

    config = read_config()
    env = config.pop("env")
    os.environ.clear()
    os.environ.update(env)  # exactly the environment a plain rank process would have
    import tempfile

    tempfile.tempdir = None  # TMPDIR may differ: computed again on first use
    from spark_estimators.task import child

    child.main(config)


if __name__ == "__main__":
    main()
