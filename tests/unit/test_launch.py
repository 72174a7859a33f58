"""The local launcher: rank environment, [rank] output, fail-fast, run_local results/failures."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from spark_estimators import envvars as ev
from spark_estimators.errors import TrainingFailedError
from spark_estimators.launch import run_local
from spark_estimators.local_ranks import rank_envs

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

RANK_VARS = [
    ev.MASTER_ADDR, ev.MASTER_PORT, ev.RANK, ev.WORLD_SIZE, ev.LOCAL_RANK, ev.LOCAL_WORLD_SIZE,
    ev.GROUP_RANK, ev.SE_RANK, ev.SE_SIZE, ev.SE_LOCAL_RANK, ev.SE_LOCAL_SIZE, ev.SE_CROSS_RANK,
    ev.SE_CROSS_SIZE, ev.SE_MASTER_ADDR, ev.SE_MASTER_PORT, ev.SE_BACKEND, ev.SE_HOSTNAME,
]  # fmt: skip


def _launch(tmp_path, script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", *args, str(path), "x", "--flag"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def _by_rank(stdout: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        assert line.startswith("["), line
        rank, text = line[1:].split("]", 1)
        lines.setdefault(int(rank), []).append(text)
    return lines


def test_rank_envs_are_the_spark_launchers_variables():
    from spark_estimators.driver.service import RankSettings
    from spark_estimators.task.spark_task import rank_environment

    envs = rank_envs(3, backend="gloo", master_port=12345)
    spark_style = rank_environment(
        RankSettings(1, 3, 1, 3, 0, 1, "127.0.0.1", 12345, envs[1][ev.SE_HOSTNAME]), (), "gloo"
    )
    assert envs[1] == spark_style
    assert [e[ev.RANK] for e in envs] == ["0", "1", "2"]
    assert {e[ev.MASTER_PORT] for e in envs} == {"12345"}


def test_cli_sets_the_rank_environment_and_prefixes_output(tmp_path):
    proc = _launch(
        tmp_path,
        f"""
        import json, os, sys
        print(json.dumps({{"env": {{k: os.environ.get(k) for k in {RANK_VARS!r}}},
                          "argv": sys.argv[1:]}}))
        print("second line", file=sys.stderr)
        """,
        "-np", "2", "--backend", "gloo", "--collective-timeout", "7",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = _by_rank(proc.stdout)
    assert sorted(lines) == [0, 1]
    reports = {r: json.loads(lines[r][0]) for r in lines}
    ports = {reports[r]["env"][ev.MASTER_PORT] for r in reports}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, report in reports.items():
        env = report["env"]
        assert report["argv"] == ["x", "--flag"]
        assert env[ev.RANK] == env[ev.SE_RANK] == env[ev.LOCAL_RANK] == str(r)
        assert env[ev.WORLD_SIZE] == env[ev.SE_SIZE] == env[ev.LOCAL_WORLD_SIZE] == "2"
        assert env[ev.GROUP_RANK] == env[ev.SE_CROSS_RANK] == "0"
        assert env[ev.SE_CROSS_SIZE] == "1"
        assert env[ev.MASTER_ADDR] == env[ev.SE_MASTER_ADDR] == "127.0.0.1"
        assert env[ev.SE_BACKEND] == "gloo"
        assert all(env[k] is not None for k in RANK_VARS)
    assert sorted(proc.stderr.splitlines()) == ["[0]second line", "[1]second line"]


def test_cli_passes_knobs_and_runs_modules(tmp_path):
    (tmp_path / "knobs.py").write_text(
        "import os\n"
        f"print(os.environ[{ev.COLLECTIVE_TIMEOUT!r}], os.environ[{ev.FUSION_THRESHOLD!r}], "
        f"os.environ[{ev.CYCLE_TIME!r}])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2", "--collective-timeout",
         "7", "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5", "-m", "knobs"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]7.0 2097152 3.5", "[1]7.0 2097152 3.5"]


def test_cli_timeline_filename_reaches_the_ranks(tmp_path):
    (tmp_path / "tl.py").write_text(f"import os\nprint(os.environ[{ev.TIMELINE!r}])\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2", "--timeline-filename",
         "/tmp/x/tl.json", "-m", "tl"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]/tmp/x/tl.json", "[1]/tmp/x/tl.json"]


def test_cli_takes_horovodruns_flags(tmp_path):
    (tmp_path / "flags.py").write_text(
        f"import os\nprint(os.environ[{ev.SE_BACKEND!r}], os.environ['GLOO_SOCKET_IFNAME'])\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2", "--gloo",
         "--network-interface", "lo", "--timeline-mark-cycles", "-m", "flags"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]gloo lo", "[1]gloo lo"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-np", "1"], "--min-np is not supported: elastic training is "),
        (["-H", "a:2,b:2"], "-H is not supported: Spark places the ranks"),
        (["--mpi-args=-x A"], "--mpi-args is not supported: there is no mpirun"),
        (["--cache-capacity", "5"], "--cache-capacity is not supported: there is no response"),
    ],
)
def test_cli_refuses_horovodrun_flags_without_an_equivalent(flags, message):
    from spark_estimators.launch import main

    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()) as err:
        main(["-np", "2", *flags, "train.py"])
    assert exc.value.code == 2
    assert message in err.getvalue()


def test_cli_tuning_flags_become_horovod_variables():
    from spark_estimators import run_options
    from spark_estimators.launch import _parser, split_command

    argv = [
        "-np", "2", "--autotune", "--autotune-log-file", "/tmp/at.csv",
        "--autotune-warmup-samples", "5", "--autotune-steps-per-sample", "20",
        "--autotune-bayes-opt-max-samples", "40", "--autotune-gaussian-process-noise", "0.75",
        "--hierarchical-allreduce", "--no-hierarchical-allgather", "train.py", "--autotune",
    ]  # fmt: skip
    parser = _parser()
    own, command = split_command(parser, argv)
    assert command == ["train.py", "--autotune"]  # the script's own flags stay its own
    assert run_options.tuning_env(parser.parse_args(own)) == {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "20",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "40",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.75",
    }
    assert run_options.tuning_env(parser.parse_args(["-np", "2"])) == {}


def test_cli_fails_fast_naming_the_rank_and_kills_the_others(tmp_path):
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    pid_file = tmp_path / "rank0.pid"
    started = time.monotonic()
    proc = _launch(
        tmp_path,
        f"""
        import os, signal, sys, threading
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL after the grace stops it
            with open({str(fifo)!r}, "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()
        else:
            with open({str(fifo)!r}) as f:  # blocks until rank 0 is up and has written
                open({str(pid_file)!r}, "w").write(f.read())
            sys.exit(3)
        """,
        "-np", "2", "--grace", "1",
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    assert "stopped the other ranks [0]" in proc.stderr
    assert elapsed < 30
    rank0 = int(pid_file.read_text())
    assert not psutil.pid_exists(rank0) or psutil.Process(rank0).status() == psutil.STATUS_ZOMBIE


def test_killing_the_launcher_kills_its_ranks(tmp_path):
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    script = tmp_path / "block.py"
    script.write_text(
        "import os, threading\n"
        f"with open({str(fifo)!r}, 'w') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "threading.Event().wait()\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2", str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids: list[int] = []
        while len(pids) < 2:  # each open() blocks until a rank opens the fifo to write
            with open(fifo) as f:
                pids += [int(word) for word in f.read().split()]
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    ranks = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []


def test_cli_needs_a_script():
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "give a script" in proc.stderr


def _rank_and_args(scale, offset=0):
    return int(os.environ[ev.SE_RANK]) * scale + offset, os.environ[ev.SE_SIZE]


def _fails_on_rank_1():
    if os.environ[ev.SE_RANK] == "1":
        raise ValueError("bad shard 7")
    return "ok"


def test_run_local_returns_results_by_rank():
    assert run_local(_rank_and_args, num_proc=3, args=(10,), kwargs={"offset": 1}) == [
        (1, "3"),
        (11, "3"),
        (21, "3"),
    ]


def test_run_local_reports_the_failed_rank_with_its_traceback():
    with pytest.raises(TrainingFailedError) as info:
        run_local(_fails_on_rank_1, num_proc=2)
    assert info.value.failed_ranks == [1]
    failure = info.value.worker_failures[1]
    assert failure.message == "ValueError: bad shard 7"
    assert "_fails_on_rank_1" in failure.traceback and failure.exit_code == 1
    assert "rank 1" in str(info.value)
    results = run_local(_fails_on_rank_1, num_proc=2, fail_fast=False, return_failures=True)
    assert results[0] == "ok" and results[1].message == "ValueError: bad shard 7"


def test_every_launcher_takes_the_same_backend_names():
    """run(), run_local(), launch --backend, collective.init() and the estimators share one list."""
    from spark_estimators import envvars, run_options
    from spark_estimators.collective.runtime import settings
    from spark_estimators.core import estimator
    from spark_estimators.errors import ConfigurationError

    assert envvars.BACKEND_NAMES == ("auto", "gloo", "nccl", "mpi")
    assert estimator.COLLECTIVE_BACKENDS is envvars.BACKEND_NAMES
    assert [run_options.check_backend(n) for n in envvars.BACKEND_NAMES] == list(
        envvars.BACKEND_NAMES
    )
    with pytest.raises(ConfigurationError, match=r"backend='tcp' is not one of auto, gloo, nccl"):
        run_options.check_backend("tcp")
    with pytest.raises(ConfigurationError, match=r"backend='tcp' is not one of auto, gloo, nccl"):
        run_local(lambda: 0, num_proc=1, backend="tcp")
    with pytest.raises(ConfigurationError, match="'tcp' is not one of auto, gloo, nccl, mpi"):
        settings.requested_backend("tcp")
