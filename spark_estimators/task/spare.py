"""Warm rank processes: a zygote per executor imports a rank's modules once and forks ranks.

Where a fit's time goes (bench/startup.py, 2 cores): ``import torch`` alone takes 1-7 s of a
rank's start (the more, the busier the machine), more than the Parquet write of a 100k-row
dataset, and a rank imports more than its framework before its first step (the collective
layer, ``pyarrow.dataset`` and pandas, TensorBoard and boto3: ~0.5-1 s more). So:

- each ``prepare_data`` write task, and each task of an estimator's training stage, makes sure
  its executor has a **zygote** (:mod:`spark_estimators.task.zygote`): a process started with
  the worker's environment that imports the rank's modules (:data:`PREIMPORTS`) and then waits
  (its imports overlap the write or the registration of all ranks);
- the rank of each training task is **forked** from it: a few milliseconds at any load, where a
  new interpreter pays its imports again, on a busy machine several seconds. The zygote stays
  for the next fits (a CrossValidator's folds, a param grid, a notebook's re-run), found by
  every PySpark worker of the executor at one address: it outlives the worker that started it
  (PySpark ends idle workers after a minute; TorchDistributor's tasks end theirs);
- the forked child takes the task's pipes as its standard streams, receives the rank's whole
  environment and settings on stdin and becomes an ordinary rank process
  (:mod:`spark_estimators.task.child`).

A forked rank is still a fresh process in the sense of DECISIONS ("Where a rank runs"): the
zygote has run nothing but ``import`` of the listed modules (no user code, no CUDA, no process
group, no RNG draw), each child serves exactly one rank and exits; a rank process is never
reused, so nothing of one fit (model, optimizer, RNG, environment, process group) reaches the
next. A rank is not forked (an ordinary process starts) when its environment differs from the
zygote's in a variable read at import time (``OMP_*``, ``MKL_*``, ``CUDA_*``, ``TORCH*``,
``PYTHON*``, ``LD_*``, ... see :data:`IMPORT_TIME_PREFIXES`): such a rank looks for a zygote at
another address, and e.g. ``env={"OMP_NUM_THREADS": "1"}`` always gets a process started with
it.

Only the estimators ask for it (their training function carries
``__spark_estimators_preimport__``, e.g. ``("torch", ...)``); ``run(fn)`` starts plain
processes. A zygote exits with its executor (PySpark's daemon, the workers' parent), or after
``SPARK_ESTIMATORS_SPARE_RANK_IDLE_S`` seconds (default 600) without a rank to fork;
``SPARK_ESTIMATORS_SPARE_RANKS=0`` (executor environment, e.g.
``spark.executorEnv.SPARK_ESTIMATORS_SPARE_RANKS``) turns it off; it needs Linux (abstract Unix
sockets). Cost: one idle process per executor and framework, ~320 MB RSS with torch, pyarrow
and pandas imported; its children share those pages until they write to them.
``data="stream"`` ranks are forked too: the task's spill events reach them through a FIFO that
the rank process opens (:mod:`spark_estimators.task.stream_spill`).

On a host shared with other users the address must be neither predictable nor trusted: it is
derived from a random **zygote key** kept in ``<temp dir>/spark-estimators-<uid>/zygote.key``, a
directory only our user can enter (:func:`zygote_key`); the task sends its request only to a
listener of our user and proves the key; the zygote gets the key on its stdin (never on a
command line, which ``ps`` shows to everyone). If another user's process holds the address (it
bound the name after our zygote's idle exit: abstract names can be read in ``/proc/net/unix``),
the key is replaced, which moves the address, and a new zygote starts there. If the directory is
someone else's, there is no zygote (ranks start as plain processes) and a warning says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from functools import partial
from typing import Any

from spark_estimators._base.owned import private_dir, read_owned_file, same_user_peer
from spark_estimators.envvars import env_on
from spark_estimators.task import zygote
from spark_estimators.task.zygote import ForkedRank, ZygoteGone

logger = logging.getLogger(__name__)

SPARE_ENV = "SPARK_ESTIMATORS_SPARE_RANKS"
IDLE_ENV = "SPARK_ESTIMATORS_SPARE_RANK_IDLE_S"
DEFAULT_IDLE_S = 600.0
#: The attribute of a rank function naming the modules the zygote imports (a tuple of names).
PREIMPORT_ATTR = "__spark_estimators_preimport__"

#: Environment variables read when a module is imported: a zygote started without the rank's
#: values for these does not fork that rank.
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
    "lightning": (
        "torch",
        *_RANK_MODULES,
        "spark_estimators.lightning.remote",
        "pytorch_lightning",
        "torch.utils.tensorboard",
    ),
}
#: Imported only after :func:`~spark_estimators.core.rank.light_tensorboard`, as a rank does.
_TENSORBOARD = ("tensorboard", "torch.utils.tensorboard")


def with_preimports(trainer: Callable[..., Any], framework: str) -> Callable[..., Any]:
    """``trainer`` marked with the modules the zygote that forks its rank processes imports."""
    marked = partial(trainer)
    setattr(marked, PREIMPORT_ATTR, PREIMPORTS.get(framework, ()))
    return marked


def preimports(fn: object) -> tuple[str, ...]:
    """The modules ``fn`` wants imported in the zygote (its ``__spark_estimators_preimport__``)."""
    names = getattr(fn, PREIMPORT_ATTR, ())
    return tuple(str(n) for n in names) if isinstance(names, tuple | list) else ()


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a module may read while it is imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


_lock = threading.Lock()
_started: list[subprocess.Popen[bytes]] = []  # zygotes this worker started (reaped here)


def enabled() -> bool:
    """False off Linux, or when ``SPARK_ESTIMATORS_SPARE_RANKS`` is ``0``/``false``/``no``/``off``.

    The zygote's address is an abstract Unix socket, which only Linux has.
    """
    if not sys.platform.startswith("linux"):
        return False
    return env_on(SPARE_ENV)


def _idle_s() -> float:
    try:
        return float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    except ValueError:
        return DEFAULT_IDLE_S


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # as every rank process (see rank_environment)
    return env


_KEY_FILE = "zygote.key"


def _key_dir() -> str | None:
    name = f"spark-estimators-{os.geteuid()}"
    path = private_dir(tempfile.gettempdir(), name)
    if path is None:
        logger.warning(
            "%s is not a private directory of this user (someone else made it, or others may "
            "enter it): rank processes start without a zygote",
            os.path.join(tempfile.gettempdir(), name),
        )
    return path


def _read_key(path: str) -> bytes | None:
    text = (read_owned_file(path, limit=256) or "").strip()
    if len(text) != 2 * zygote.KEY_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def zygote_key(renew: bool = False) -> bytes | None:
    """The zygote key of this user on this host (made on first use); None without a private dir.

    ``renew``: replace it (another user holds the address the old key named). Written under a
    temporary name and linked or renamed into place, so a reader never sees half a key.
    """
    directory = _key_dir()
    if directory is None:
        return None
    path = os.path.join(directory, _KEY_FILE)
    key = None if renew else _read_key(path)
    if key is not None:
        return key
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".key-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(os.urandom(zygote.KEY_BYTES).hex())
    if renew:
        os.replace(tmp, path)
    else:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # unless another worker wrote one meanwhile: then that one
        os.unlink(tmp)
    return _read_key(path)


def address(preimport: tuple[str, ...], env: dict[str, str], key: bytes) -> str:
    """The zygote's abstract socket for ranks with ``env``, in this worker's executor.

    Named after the zygote key, the user, the workers' parent (PySpark's daemon: one per
    executor and Python environment), the modules and the import-time variables, so every worker
    of the executor finds the zygote any of them started, a rank whose import-time variables
    differ finds none, and nobody without the key can tell the name in advance.
    """
    parts = repr((os.getuid(), os.getppid(), preimport, sorted(import_time_env(env).items())))
    digest = hashlib.sha256(key + parts.encode()).hexdigest()[:32]
    return "\0spark-estimators-zygote-" + digest


def _held_by_stranger(addr: str) -> bool:
    """Whether a process of another user listens at ``addr``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(addr)
        except OSError:
            return False  # nobody listens (a zygote that just ended): bind again next time
        return not same_user_peer(probe)


def ensure(preimport: tuple[str, ...]) -> None:
    """Start the executor's zygote for ``preimport`` unless one runs (a task or write starts).

    Its imports then overlap the write, or the registration of all ranks; later fits find it
    ready, whichever worker runs their tasks.
    """
    if not preimport or not enabled():
        return
    env = _worker_env()
    with _lock:
        _started[:] = [p for p in _started if p.poll() is None]
        key = zygote_key()
        if key is None:
            return
        addr = address(preimport, env, key)
        listener = zygote.listen(addr)
        if listener is None and _held_by_stranger(addr):
            logger.warning("another user holds this executor's zygote address: moving it")
            key = zygote_key(renew=True)
            listener = zygote.listen(address(preimport, env, key)) if key else None
        if listener is None or key is None:
            return  # a zygote of ours holds the address already
        with listener:
            _started.append(_start(preimport, env, listener, key))


def _start(
    preimport: tuple[str, ...], env: dict[str, str], listener: socket.socket, key: bytes
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spark_estimators.task.spare_process",
            str(_idle_s()),
            str(listener.fileno()),
            str(os.getppid()),
            *preimport,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        pass_fds=(listener.fileno(),),
    )
    assert proc.stdin is not None
    with proc.stdin:  # the key travels on stdin: a command line is visible to every user
        proc.stdin.write(key.hex().encode() + b"\n")
    return proc


def take(preimport: tuple[str, ...], env: dict[str, str]) -> ForkedRank | None:
    """A rank process forked from the executor's zygote for a rank with environment ``env``.

    None (start an ordinary process) when this is off, no zygote has ``preimport`` imported
    under ``env``'s import-time variables, or it does not answer. Waits while the zygote is
    still importing: its imports are further along than a new process's.
    """
    if not preimport or not enabled():
        return None
    key = zygote_key()
    if key is None:
        return None
    try:
        return zygote.request_fork(address(preimport, env, key), key)
    except ZygoteGone:
        return None


def main() -> None:
    """The zygote process: import, then fork a rank per request (:func:`zygote.serve`)."""
    idle_s, fd, executor = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    names = sys.argv[4:]
    key = bytes.fromhex(sys.stdin.readline().strip())
    os.close(0)  # the rank's stdin comes with each request
    os.open(os.devnull, os.O_RDONLY)
    from spark_estimators.task import context, lazy_dynamo

    context.mark("zygote_started")
    lazy_dynamo.install()  # as a plain rank: before torch, so eager training never loads dynamo
    for name in names:
        try:
            if name in _TENSORBOARD and "tensorflow" not in sys.modules:
                # core.rank.light_tensorboard (not imported: core -> data -> task would circle)
                sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank's own import will report it
            pass
    context.mark("zygote_imported")
    try:
        zygote.serve(socket.socket(fileno=fd), idle_s, become_rank, executor, key=key)
    except ProcessLookupError:
        pass  # the executor ended while this imported
    os._exit(0)


def become_rank() -> None:
    """In a child forked by the zygote: read the rank's settings on stdin and run as that rank."""
    from spark_estimators._base.child import read_config
    from spark_estimators.task import child, context

    context.mark("spare_forked")
    config = read_config()
    env = config.pop("env")
    os.environ.clear()
    os.environ.update(env)  # exactly the environment a plain rank process would have
    tempfile.tempdir = None  # TMPDIR may differ: computed again on first use
    child.main(config)
