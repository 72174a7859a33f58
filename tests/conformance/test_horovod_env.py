"""The launcher sets horovodrun's rank variables (Gloo) as horovod-era code expects them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, os
names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
         "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
print("ENV " + json.dumps({n: os.environ.get(n) for n in names}))
"""


def _rank_envs(tmp_path, backend: str) -> list[dict]:
    script = tmp_path / "env.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "spark_estimators.launch", "-np", "2", "--backend", backend]
    proc = subprocess.run(
        [*cmd, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    envs = {}
    for line in proc.stdout.splitlines():
        prefix, sep, payload = line.partition("ENV ")
        if sep:
            envs[int(prefix.strip("[]"))] = json.loads(payload)
    return [envs[0], envs[1]]


@pytest.mark.multiprocess
def test_launcher_sets_horovodrun_gloo_rank_variables(tmp_path):
    envs = _rank_envs(tmp_path, "gloo")
    for rank, env in enumerate(envs):
        assert env == {
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": "2",
            "HOROVOD_LOCAL_RANK": str(rank),
            "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_CROSS_SIZE": "1",
        }


@pytest.mark.multiprocess
def test_launcher_sets_no_horovod_rank_variables_under_mpi(tmp_path):
    # As horovodrun: under MPI code reads the MPI launcher's variables, not HOROVOD_RANK.
    for env in _rank_envs(tmp_path, "mpi"):
        assert set(env.values()) == {None}
