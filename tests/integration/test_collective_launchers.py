"""The same collective code runs inside spark_estimators.run(fn) and under torchrun."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

import spark_estimators

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _collective_hello(magic_number):
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    summed = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    ranks = hvd.allgather_object(hvd.rank())
    info = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.backend_name())
    hvd.shutdown()
    return info, float(summed), ranks, magic_number


@pytest.mark.spark
def test_collective_inside_spark_run(spark):
    out = spark_estimators.run(_collective_hello, args=(42,), num_proc=2, spark=spark)
    assert out == [
        ((0, 2, 0, "gloo"), 3.0, [0, 1], 42),
        ((1, 2, 1, "gloo"), 3.0, [0, 1], 42),
    ]


def test_collective_under_torchrun(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import spark_estimators.collective.torch as hvd
            hvd.init()
            total = hvd.allreduce(torch.ones(1) * (hvd.rank() + 1), op=hvd.Sum)
            print(f"RESULT {hvd.rank()} {hvd.size()} {hvd.local_rank()} {float(total)}")
            hvd.shutdown()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Both ranks write to one pipe: two lines can arrive glued together, so match records.
    records = sorted(re.findall(r"RESULT \d+ \d+ \d+ [\d.]+", proc.stdout))
    assert records == ["RESULT 0 2 0 3.0", "RESULT 1 2 1 3.0"]
