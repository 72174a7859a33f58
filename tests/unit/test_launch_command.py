"""issue 25 item 9: everything after the script or ``-m module`` is the ranks' command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spark_estimators.launch import _parser, split_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _launch(tmp_path, *words):
    (tmp_path / "echo_args.py").write_text(
        "import json, os, sys\nprint(json.dumps([os.environ['RANK'], sys.argv[1:]]))\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", *words],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return sorted(json.loads(line.split("]", 1)[1]) for line in proc.stdout.splitlines())


def test_options_after_a_module_belong_to_the_module(tmp_path):
    # was: "unrecognized arguments: -q" (argparse took -q for a launcher option)
    got = _launch(tmp_path, "-np", "2", "-m", "echo_args", "-q", "-np", "5", "--grace=1")
    assert got == [["0", ["-q", "-np", "5", "--grace=1"]], ["1", ["-q", "-np", "5", "--grace=1"]]]


def test_options_after_a_script_belong_to_the_script(tmp_path):
    got = _launch(tmp_path, "-np", "2", "--gloo", "echo_args.py", "-v", "--backend", "mpi")
    assert got == [["0", ["-v", "--backend", "mpi"]], ["1", ["-v", "--backend", "mpi"]]]


@pytest.mark.parametrize(
    ("argv", "own", "command"),
    [
        (["-np", "2", "-m", "pytest", "-q"], ["-np", "2"], ["-m", "pytest", "-q"]),
        (["-np", "2", "-m", "pytest", "--", "-q"], ["-np", "2"], ["-m", "pytest", "-q"]),
        (["-np", "2", "-mpytest", "-x"], ["-np", "2"], ["-m", "pytest", "-x"]),
        (
            ["-np=2", "--grace", "3", "t.py", "-np", "4"],
            ["-np=2", "--grace", "3"],
            ["t.py", "-np", "4"],
        ),
        (["--num", "2", "t.py"], ["--num", "2"], ["t.py"]),  # argparse's unique prefix of a flag
        (["-np", "2", "--", "t.py", "-q"], ["-np", "2"], ["t.py", "-q"]),
        (["-np", "2", "--gloo", "-v"], ["-np", "2", "--gloo", "-v"], []),
    ],
)
def test_split_command(argv, own, command):
    assert split_command(_parser(), argv) == (own, command)
