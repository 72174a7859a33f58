"""Spare rank processes: a fresh rank process started ahead of time with the framework imported.

Where a fit's time goes (bench/startup.py, 2 cores): ``import torch`` alone takes 1-7 s of a
rank's start (the more, the busier the machine), more than the Parquet write of a 100k-row
dataset. The rank cannot start while ``prepare_data`` writes on a cluster whose slots are all
needed by the training stage (barrier mode runs only when all ``num_proc`` tasks have a slot, and
the write job needs slots too), so the import is moved off the critical path instead:

- each ``prepare_data`` write task starts a **spare** in its PySpark worker (its imports then
  overlap the write; the training stage's tasks mostly run in the same workers next), and the
  Spark task of an estimator's training stage starts one as its first act if its worker has
  none (the imports then overlap the registration of all ranks);
- as soon as a rank has adopted a spare, its task fills the worker's **stock** up again
  (``SPARK_ESTIMATORS_SPARE_RANKS`` spares, default 2) for the next fits this worker runs (a
  CrossValidator's next fit, a notebook's re-run): those import at ``SCHED_IDLE`` priority, on
  the cycles the running fit leaves unused, and get the normal priority back when adopted. Two,
  because a later fit often starts ~1.5 s after the previous one began (same data, no write),
  less than one import on a busy machine: the older spare is ready while the newer imports;
- the rank imports more than its framework before its first step (the collective layer,
  ``pyarrow.dataset`` and pandas, TensorBoard and boto3: ~0.5-1 s): a spare imports these too
  (:data:`PREIMPORTS`);
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
e.g. ``spark.executorEnv.SPARK_ESTIMATORS_SPARE_RANKS``) turns spares off, ``=1`` keeps one.
Cost: up to the stock of idle processes per PySpark worker that ran a training task, ~350 MB
RSS each with torch, pyarrow and pandas imported.
``data="stream"`` ranks take spares too: the task's spill events reach them through a FIFO
that the rank process opens (:mod:`spark_estimators.task.stream_spill`).
"""

from __future__ import annotations

import importlib
import os
import select
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

from spark_estimators._base.processes import kill_group

SPARE_ENV = "SPARK_ESTIMATORS_SPARE_RANKS"
IDLE_ENV = "SPARK_ESTIMATORS_SPARE_RANK_IDLE_S"
DEFAULT_IDLE_S = 600.0
DEFAULT_STOCK = 2
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
    "ARROW_",
    "PANDAS_",
    "NUMEXPR_",
    "AWS_",
    "BOTO",
)


@dataclass
class Spare:
    """One spare process of this PySpark worker, with the environment it was started with."""

    proc: subprocess.Popen[bytes]
    preimport: tuple[str, ...]
    env: dict[str, str]
    idle: bool = False  # importing at SCHED_IDLE priority


_lock = threading.Lock()
_spares: list[Spare] = []  # this worker's stock, oldest first


#: What every estimator rank imports before its first step besides its framework: the rank's
#: entry, the collective layer, the reader (``pyarrow.dataset`` brings pandas) and rank 0's
#: TensorBoard writer (which brings boto3): ~0.5-1 s of imports that a spare does ahead.
_RANK_MODULES = (
    "cloudpickle",
    "spark_estimators.driver.rpc",
    "spark_estimators.driver.store_client",
    "spark_estimators.core.rank",
    "spark_estimators.data.reader",
    "pyarrow.dataset",
    "pyarrow.parquet",
)
#: Modules the estimators' spare rank processes import, by framework (in this order).
PREIMPORTS = {
    "torch": (
        "torch",
        *_RANK_MODULES,
        "spark_estimators.collective.torch",
        "spark_estimators.torch.remote",
        "torch.utils.tensorboard",
    ),
    "lightning": ("torch", *_RANK_MODULES, "spark_estimators.lightning.remote"),
}
#: Imported only after :func:`~spark_estimators.core.rank.light_tensorboard`, as a rank does.
_TENSORBOARD = ("tensorboard", "torch.utils.tensorboard")


def with_preimports(trainer: Callable[..., Any], framework: str) -> Callable[..., Any]:
    """``trainer`` marked with the modules its spare rank processes import ahead."""
    marked = partial(trainer)
    setattr(marked, PREIMPORT_ATTR, PREIMPORTS.get(framework, ()))
    return marked


def stock() -> int:
    """Spares kept per PySpark worker: ``SPARK_ESTIMATORS_SPARE_RANKS`` (default 2; 0: none).

    ``0``/``false``/``no``/``off`` turn spares off; an integer keeps that many (one is adopted by
    the worker's next rank, the others are already importing for the fits after it).
    """
    raw = os.environ.get(SPARE_ENV, "").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        return DEFAULT_STOCK


def enabled() -> bool:
    """False when ``SPARK_ESTIMATORS_SPARE_RANKS=0`` in this (executor) process."""
    return stock() > 0


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


def ensure(preimport: tuple[str, ...], background: bool = False) -> None:
    """Keep this worker's stock of live spares with ``preimport`` imported (start what is missing).

    Without ``background`` (a task or a write starting, a rank ended) a worker with no spare
    starts one at the normal CPU priority, and its oldest spare, the one the worker's next rank
    takes, gets the normal priority back: that rank comes in a moment. Spares started to fill the
    stock up to ``SPARK_ESTIMATORS_SPARE_RANKS`` (``background``: while this worker's rank
    trains) import at the lowest priority (``SCHED_IDLE``: only cycles the running fit leaves
    unused); a rank that adopts one gives it the normal priority too (:func:`take`).
    """
    if not preimport or not enabled():
        return
    with _lock:
        live = [sp for sp in _spares if sp.proc.poll() is None and sp.preimport == preimport]
        for sp in _spares:
            if sp not in live:
                _discard(sp)
        _spares[:] = live
        if not live and not background:
            _spares.append(_start(preimport, idle=False))
        elif live and live[0].idle and not background:
            live[0].idle = not normal_priority(live[0].proc.pid)  # still idle: take() skips it
        while len(_spares) < stock() and idle_allowed():  # else they would slow the fit
            _spares.append(_start(preimport, idle=True))


def _start(preimport: tuple[str, ...], idle: bool) -> Spare:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # as every rank process (see rank_environment)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spark_estimators.task.spare_process",
            str(_idle_s()),
            "idle" if idle else "normal",
            *preimport,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    if idle:  # at once, not only when the spare gets to it (it does too: its threads)
        idle = idle_priority(proc.pid)
    return Spare(proc, preimport, env, idle)


def take(preimport: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """The oldest usable spare of this worker for a rank with environment ``env``; None: none.

    Usable: alive, with ``preimport`` imported, started with the same import-time variables as
    ``env`` (see :data:`IMPORT_TIME_PREFIXES`). Dead ones are discarded; live ones that another
    environment cannot use stay for later ranks.
    """
    if not preimport:
        return None
    with _lock:
        for sp in list(_spares):
            if sp.proc.poll() is not None:
                _spares.remove(sp)
                _discard(sp)
            elif sp.preimport == preimport and import_time_env(sp.env) == import_time_env(env):
                _spares.remove(sp)
                break
        else:
            return None
    # its remaining imports are now on the rank's critical path; stuck idle, it is no use
    if not normal_priority(sp.proc.pid) and sp.idle:
        _discard(sp)
        return None
    return sp.proc


@cache
def idle_allowed() -> bool:
    """True when this process may give a thread at ``SCHED_IDLE`` the normal policy back.

    Linux treats ``SCHED_IDLE`` as nice 20 and lets a thread leave it only where
    ``RLIMIT_NICE`` allows its nice value or with ``CAP_SYS_NICE`` (sched(7)); the usual limit,
    0, allows nothing. A spare idled where that is refused would train, once adopted, on the
    cycles nobody else wants, so spares go idle only where this is True. It is found by trying:
    a short-lived thread of this process goes idle and asks to come back.
    """
    idle, other = getattr(os, "SCHED_IDLE", None), getattr(os, "SCHED_OTHER", None)
    if idle is None or other is None:
        return False
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, idle, os.sched_param(0))
        except OSError:
            result.append(False)
            return
        try:
            os.sched_setscheduler(tid, other, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="spare-priority-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


def idle_priority(pid: int) -> bool:
    """Run process ``pid``'s threads at ``SCHED_IDLE``; False (nothing changed) where not allowed.

    Only where :func:`idle_allowed`: a spare that could not get the normal policy back is worse
    than one importing at the normal priority.
    """
    if not idle_allowed():
        return False
    return _set_policy(pid, getattr(os, "SCHED_IDLE", None))


def normal_priority(pid: int) -> bool:
    """Give every thread of process ``pid`` the normal policy back (``SCHED_OTHER``, nice kept).

    True when every thread has it (a spare that stays idle is not adopted: see :func:`take`).
    """
    return _set_policy(pid, getattr(os, "SCHED_OTHER", None))


def _set_policy(pid: int, policy: int | None) -> bool:
    if policy is None:
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    done = True
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except (OSError, AttributeError):
            done = False
    return done


def main() -> None:
    """The spare process: import, wait for a rank's config, then run as that rank."""
    idle_s, priority, names = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if priority == "idle":
        idle_priority(os.getpid())
    from spark_estimators.task import context, lazy_dynamo

    context.mark("spare_started")
    lazy_dynamo.install()  # as a plain rank: before torch, so eager training never loads dynamo
    stdin = sys.stdin.buffer
    for i, name in enumerate(names):
        if i and select.select([stdin], [], [], 0)[0]:
            break  # a rank (or EOF) came: it imports what it still needs itself, as a plain rank
        try:
            if name in _TENSORBOARD and "tensorflow" not in sys.modules:
                # core.rank.light_tensorboard (not imported: core -> data -> task would circle)
                sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank's own import will report it
            pass
    context.mark("spare_imported")
    ready, _, _ = select.select([stdin], [], [], idle_s)
    if not ready or not getattr(stdin, "peek", lambda _n: b"x")(1):  # idle, or worker gone
        os._exit(0)
    from spark_estimators._base.child import read_config

    config = read_config()
    normal_priority(os.getpid())  # the adopting task did too; threads started since included
    env = config.pop("env")
    os.environ.clear()
    os.environ.update(env)  # exactly the environment a plain rank process would have
    import tempfile

    tempfile.tempdir = None  # TMPDIR may differ: computed again on first use
    from spark_estimators.task import child

    child.main(config)


if __name__ == "__main__":
    main()
