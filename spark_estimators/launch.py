"""Local launcher, the one-machine ``horovodrun``: ``python -m spark_estimators.launch -np N``.

Usage::

    python -m spark_estimators.launch -np 2 train.py --epochs 3
    python -m spark_estimators.launch -np 2 -m my_package.train

Each rank is a fresh ``python`` process in its own session with the same variables a rank of
:func:`spark_estimators.run` gets (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... and
ours, ``SPARK_ESTIMATORS_RANK`` ...), rendezvous on ``127.0.0.1`` and a free port. With
``--backend mpi`` the launcher also serves MPICH's PMI-1 protocol (like ``mpiexec``), so the
ranks' ``MPI_COMM_WORLD`` is the job (see :mod:`spark_estimators.driver.pmi`). Output lines
are prefixed ``[rank]``. Fail fast: when a rank exits non-zero the others' process groups get
SIGTERM, then SIGKILL after a grace period, and the launcher exits non-zero naming the rank.
A launcher that dies takes its ranks with it (``PR_SET_PDEATHSIG`` / a stdin lifeline).

:func:`run_local` does the same for a Python function and returns the per-rank results; it is
how the tests run code in N real processes without Spark.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import IO, TypeVar, cast

from spark_estimators import envvars as ev
from spark_estimators import run_options
from spark_estimators._base.child import exit_now, start_lifeline
from spark_estimators._base.processes import exit_words
from spark_estimators.driver.launch_job import LaunchOptions
from spark_estimators.errors import ConfigurationError, RemoteError, TrainingFailedError
from spark_estimators.local_ranks import DEFAULT_GRACE_S, Supervisor, run_ranks

__all__ = ["main", "run_local"]

T = TypeVar("T")

_WORKER_FLAG = "--run-pickled-function"


# -- run_local: a Python function in N processes --------------------------------------------
def run_local(
    fn: Callable[..., T],
    num_proc: int = 2,
    args: Sequence[object] = (),
    kwargs: dict[str, object] | None = None,
    *,
    env: dict[str, str] | None = None,
    backend: str = "auto",
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    fail_fast: bool = True,
    return_failures: bool = False,
    grace: float = DEFAULT_GRACE_S,
) -> list[T | RemoteError | None]:
    """Run ``fn(*args, **kwargs)`` in ``num_proc`` local rank processes; results by rank.

    Parameters
    ----------
    fn
        A picklable (cloudpickle) function; it calls ``collective.init()`` itself.
    num_proc
        Number of ranks.
    args, kwargs
        Arguments for ``fn``.
    env
        Extra environment variables for the ranks (e.g. ``SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT``).
    backend
        Value of ``SPARK_ESTIMATORS_BACKEND`` in the ranks.
    stdout, stderr
        Where the ranks' ``[rank]``-prefixed output goes (default ``sys.stdout``/``sys.stderr``).
    fail_fast
        Stop the other ranks as soon as one fails (default). False lets survivors finish, e.g.
        to observe how they react to a dead peer.
    return_failures
        Put a :class:`~spark_estimators.errors.RemoteError` in the list for each failed rank
        instead of raising.
    grace
        Seconds between SIGTERM and SIGKILL when stopping ranks.

    Returns
    -------
    list
        ``fn``'s return value of rank 0, 1, ...

    Raises
    ------
    TrainingFailedError
        A rank raised or died (unless ``return_failures``); ``worker_failures`` has the details.

    Examples
    --------
    >>> def fn():
    ...     import spark_estimators.collective as hvd
    ...     hvd.init()
    ...     return hvd.rank()
    >>> run_local(fn, num_proc=2)  # doctest: +SKIP
    [0, 1]
    """
    import cloudpickle

    options = LaunchOptions(
        num_proc=num_proc, env=env, backend=backend, stdout=stdout, stderr=stderr
    )
    with tempfile.TemporaryDirectory(prefix="se-launch-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump((list(sys.path), cloudpickle.dumps((fn, tuple(args), kwargs or {}))), f)
        command = [sys.executable, "-m", "spark_estimators.launch", _WORKER_FLAG, payload]
        supervisor = run_ranks(
            command, options, fail_fast=fail_fast, grace=grace, stdin_lifeline=True
        )
        results, failures, stopped = _collect(tmp, supervisor)
    if failures and not return_failures:
        first = supervisor.first_failure
        raise TrainingFailedError(
            f"{len(failures)} of {num_proc} ranks failed (first: rank {first}); "
            + (f"ranks {sorted(stopped)} were stopped" if stopped else "no rank was stopped"),
            failures,
        )
    merged = {**results, **stopped, **failures}
    # fn's results; with return_failures a RemoteError (or None) for a rank that failed
    return cast("list[T | RemoteError | None]", [merged.get(r) for r in range(num_proc)])


def _collect(
    tmp: str, supervisor: Supervisor
) -> tuple[dict[int, object], dict[int, RemoteError], dict[int, RemoteError]]:
    """Results, genuine failures, and ranks the launcher stopped after another one failed."""
    import cloudpickle

    results: dict[int, object] = {}
    failures: dict[int, RemoteError] = {}
    stopped: dict[int, RemoteError] = {}
    host = socket.gethostname()
    for rank, code in supervisor.codes.items():
        path = os.path.join(tmp, f"result.{rank}.pkl")
        report = None
        if os.path.exists(path):
            with open(path, "rb") as f:
                report = cloudpickle.loads(f.read())
        if report is not None and report[0] == "ok" and code == 0:
            results[rank] = report[1]
        elif report is not None and report[0] == "error":
            failures[rank] = RemoteError(rank, host, report[1], report[2], code)
        elif rank in supervisor.stopped:
            stopped[rank] = RemoteError(
                rank,
                host,
                f"stopped by the launcher after rank {supervisor.first_failure} failed",
                exit_code=code,
            )
        else:
            failures[rank] = RemoteError(
                rank,
                host,
                f"the rank process {exit_words(code)} without reporting a result",
                exit_code=code,
            )
    return results, failures, stopped


def _worker_main(payload_path: str) -> None:
    import cloudpickle

    from spark_estimators.task import lazy_dynamo

    lazy_dynamo.install()  # as in task.child: eager training never pays for torch._dynamo
    start_lifeline()
    rank = int(os.environ.get(ev.SE_RANK, "0"))
    result_path = os.path.join(os.path.dirname(payload_path), f"result.{rank}.pkl")
    code = 0
    try:
        with open(payload_path, "rb") as f:
            sys_path, blob = pickle.load(f)
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        fn, args, kwargs = cloudpickle.loads(blob)
        report: tuple[object, ...] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # report everything, SystemExit included
        code = 1
        report = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sys.stderr.write(report[2])
    try:
        data = cloudpickle.dumps(report)
    except Exception as exc:
        code = 1
        data = cloudpickle.dumps(("error", f"the result could not be pickled: {exc}", ""))
    with open(result_path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(result_path + ".tmp", result_path)
    exit_now(code)


# -- command line ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spark_estimators.launch",
        description="Run a training script in N local processes (the one-machine horovodrun).",
    )
    p.add_argument("-np", "--num-proc", type=int, required=True, help="number of ranks")
    p.add_argument("--backend", choices=ev.BACKEND_NAMES, default="auto", help="collective backend")
    p.add_argument("--gloo", dest="backend", action="store_const", const="gloo",
                   help="horovodrun's flag: --backend gloo")  # fmt: skip
    p.add_argument("--mpi", dest="backend", action="store_const", const="mpi",
                   help="horovodrun's flag: --backend mpi")  # fmt: skip
    p.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="nics",
        help="comma-separated interfaces for the collectives (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME)",
    )
    p.add_argument("--timeline-mark-cycles", action="store_true",
                   help="accepted for horovodrun compatibility (no cycles to mark)")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="accepted (horovodrun's flag)")
    run_options.add_unsupported_launcher_flags(p)
    run_options.add_tuning_launcher_flags(p)
    p.add_argument("--start-timeout", type=float, help=f"seconds, sets {ev.START_TIMEOUT}")
    p.add_argument(
        "--collective-timeout", type=float, help=f"seconds, sets {ev.COLLECTIVE_TIMEOUT}"
    )
    p.add_argument(
        "--fusion-threshold-mb",
        type=float,
        help=f"MiB per fused bucket, sets {ev.FUSION_THRESHOLD}",
    )
    p.add_argument(
        "--cycle-time-ms",
        type=float,
        help=f"milliseconds (fusion of async ops), sets {ev.CYCLE_TIME}",
    )
    p.add_argument(
        "--timeline-filename",
        "--timeline",
        help=f"write each rank's collective timeline (Chrome trace) here, sets {ev.TIMELINE}",
    )
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument(
        "--prefix-output-with-timestamp", action="store_true", help="timestamp every line"
    )
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="SIGTERM->SIGKILL, s")
    p.add_argument("-m", dest="module", help="run a module (like python -m) instead of a script")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def split_command(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[list[str], list[str]]:
    """``argv`` -> (the launcher's own options, the ranks' command after ``python -u``).

    As with ``horovodrun`` and ``python`` itself, everything from the script (the first
    positional word) or from ``-m module`` on is the user's command: ``-np 2 -m pytest -q``
    runs ``pytest -q`` in each rank (argparse alone took ``-q`` for an unknown launcher option).
    A ``--`` before the script, or right after it (the old workaround), is dropped.

    >>> split_command(_parser(), ["-np", "2", "--gloo", "-m", "pytest", "-q", "-x"])
    (['-np', '2', '--gloo'], ['-m', 'pytest', '-q', '-x'])
    >>> split_command(_parser(), ["-np", "2", "--grace", "3", "train.py", "--", "-np", "4"])
    (['-np', '2', '--grace', '3'], ['train.py', '-np', '4'])
    """
    words = list(argv)
    takes_value = {
        flag: action.nargs != 0
        for action in parser._actions  # argparse has no public view of them
        for flag in action.option_strings
    }
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[:i], _command(words[i + 1 :])
        if word == "-m" or (word.startswith("-m") and word not in takes_value and word[2:3] != "-"):
            module = words[i + 1 : i + 2] if word == "-m" else [word[2:]]
            rest = words[i + 2 :] if word == "-m" else words[i + 1 :]
            return words[:i], ["-m", *module, *_drop_separator(rest)]
        if word.startswith("-") and word != "-":
            flag = word.split("=", 1)[0]
            if flag not in takes_value and flag.startswith("--"):  # argparse's unique prefixes
                longer = [f for f in takes_value if f.startswith(flag)]
                flag = longer[0] if len(longer) == 1 else flag
            i += 2 if takes_value.get(flag, False) and "=" not in word else 1
            continue
        return words[:i], _command(words[i:])
    return words, []


def _command(words: list[str]) -> list[str]:
    if words[:1] == ["-m"]:
        return ["-m", *words[1:2], *_drop_separator(words[2:])]
    return words[:1] + _drop_separator(words[1:])


def _drop_separator(words: list[str]) -> list[str]:
    return words[1:] if words[:1] == ["--"] else words


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m spark_estimators.launch``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == _WORKER_FLAG:
        _worker_main(argv[1])
    parser = _parser()
    own, target = split_command(parser, argv)
    opts = parser.parse_args(own)
    if not target or target == ["-m"]:
        parser.error("give a script (train.py ...) or -m module")
    extra = run_options.tuning_env(opts)
    if opts.start_timeout is not None:
        extra[ev.START_TIMEOUT] = str(opts.start_timeout)
    if opts.collective_timeout is not None:
        extra[ev.COLLECTIVE_TIMEOUT] = str(opts.collective_timeout)
    if opts.fusion_threshold_mb is not None:
        extra[ev.FUSION_THRESHOLD] = str(int(opts.fusion_threshold_mb * 1024 * 1024))
    if opts.cycle_time_ms is not None:
        extra[ev.CYCLE_TIME] = str(opts.cycle_time_ms)
    try:
        nics = opts.nics.split(",") if opts.nics else None
        options = LaunchOptions(
            num_proc=opts.num_proc,
            env=run_options.rank_env(extra, nics=nics, timeline=opts.timeline_filename or None),
            backend=opts.backend,
            prefix_output_with_timestamp=opts.prefix_output_with_timestamp,
        )
    except ConfigurationError as exc:
        parser.error(str(exc))
    command = [sys.executable, "-u", *target]
    try:
        supervisor = run_ranks(command, options, master_port=opts.master_port, grace=opts.grace)
    except KeyboardInterrupt:
        sys.stderr.write("spark_estimators.launch: interrupted; all ranks were killed\n")
        return 130
    codes = supervisor.codes
    failed = supervisor.first_failure
    if failed is None:
        return 0
    others = sorted(r for r in codes if r != failed)
    sys.stderr.write(
        f"spark_estimators.launch: rank {failed} {exit_words(codes[failed])}; "
        f"stopped the other ranks {others}\n"
    )
    code = codes[failed]
    return code if code > 0 else 128 + (-code)


if __name__ == "__main__":
    sys.exit(main())
