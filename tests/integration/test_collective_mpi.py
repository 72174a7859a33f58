"""The MPI backend: the collective op suite and DistributedOptimizer training on MPI.

The op suite of ``test_collective_ops`` (the same function, the same assertions, imported from
there) runs three ways, each with 2 real processes:

* ``launch``: ``run_local(..., backend="mpi")``, whose launcher serves PMI like ``mpiexec``;
* ``mpiexec``: MPICH's own ``mpiexec -n 2 python this_file.py`` (``init()`` detects MPI);
* ``spark``: ``spark_estimators.run(..., backend="mpi")`` on local[2], the driver serving PMI.

Each run adds MPI-specific checks (:func:`_mpi_extras`): the thread level, bfloat16 and bool
reductions, user mpi4py calls mixed with ours, and ``init(comm=...)``. Failure handling (a
raising or killed rank, a silent peer) is checked at the end.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

# Reused suites: importing the test functions makes pytest run them here with this module's
# fixtures (suite, data, trained), i.e. on the MPI backend.
from test_collective_ops import (  # noqa: F401
    SIZE,
    _op_suite,
    _rank_data,
    test_allgather_uneven_first_dimension,
    test_allreduce_ops_match_numpy,
    test_alltoall_with_and_without_splits,
    test_autograd,
    test_broadcast,
    test_broadcast_parameters_and_optimizer_state,
    test_fp16_compression_within_tolerance,
    test_grouped_allreduce,
    test_inplace_and_async,
    test_integers_average_and_scale_as_in_horovod,
    test_join,
    test_mismatch_raises_on_every_rank_naming_the_tensor,
    test_numpy_core_api,
    test_objects,
    test_prescale_and_postscale,
    test_reducescatter,
    test_shutdown_then_ops_explain_init,
)
from test_collective_training import (  # noqa: F401
    CONFIGS,
    _train,
    test_buckets_follow_the_fusion_threshold_and_launch_during_backward,
    test_misuse_is_reported,
    test_ranks_identical_and_equal_to_single_process,
    test_sync_batch_norm_running_stats_match,
    test_training_really_moved_the_weights,
)

import spark_estimators
from spark_estimators import envvars as ev
from spark_estimators.errors import TrainingFailedError
from spark_estimators.launch import run_local

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py"),
]

MPIEXEC = Path(sys.executable).with_name("mpiexec")
HERE = Path(__file__).resolve().parent


def _mpi_extras() -> dict:
    """MPI-only checks, run after the shared op suite in the same processes."""
    import threading

    import torch
    from mpi4py import MPI

    import spark_estimators.collective as core
    import spark_estimators.collective.torch as hvd

    out: dict = {}
    hvd.init()
    r = hvd.rank()
    out["threads"] = (hvd.mpi_threads_supported(), MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    out["mpi_enabled"] = core.mpi_enabled()
    # bfloat16 goes through an MPI user op (float32 arithmetic), bool through logical ops
    bf16 = torch.tensor([1.5, -2.0, 3.25] * 200, dtype=torch.bfloat16) * (r + 1)
    out["bf16_sum"] = hvd.allreduce(bf16, op=hvd.Sum).float().numpy()
    out["bf16_max"] = hvd.allreduce(bf16, op=hvd.Max).float().numpy()
    flags = np.zeros(1000, dtype=bool)
    flags[r] = True
    out["bool_sum"] = core.allreduce(flags, op=core.Sum)
    out["bool_min"] = core.allreduce(flags, op=core.Min)
    # user mpi4py calls on COMM_WORLD while our async allreduce runs on the engine thread
    big = torch.ones(1 << 20)
    handle = hvd.allreduce_async_(big, op=hvd.Sum, name="overlap")
    out["user_allreduce"] = MPI.COMM_WORLD.allreduce(r + 1)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(MPI.COMM_WORLD.bcast(r, root=1)))
    thread.start()
    thread.join()
    out["user_bcast_from_thread"] = got[0]
    out["overlap_sum"] = float(hvd.synchronize(handle)[0])
    hvd.shutdown()
    # init(comm=...): a communicator with the ranks reversed, then a list of one rank each
    reverse = MPI.COMM_WORLD.Split(color=0, key=-MPI.COMM_WORLD.Get_rank())
    hvd.init(comm=reverse)
    out["reversed"] = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    out["reversed_gather"] = hvd.allgather_object(MPI.COMM_WORLD.Get_rank())
    hvd.shutdown()
    reverse.Free()
    hvd.init(comm=[MPI.COMM_WORLD.Get_rank()])
    out["alone"] = (hvd.size(), float(hvd.allreduce(torch.ones(1) * 7, op=hvd.Sum)))
    hvd.shutdown()
    return out


def _suite_and_extras() -> dict:
    return {"ops": _op_suite(), "mpi": _mpi_extras()}


def _mpiexec_main(out_dir: str) -> None:
    """Entry point of ``mpiexec -n 2 python test_collective_mpi.py OUT_DIR``."""
    from mpi4py import MPI

    result = _suite_and_extras()
    path = Path(out_dir) / f"rank{MPI.COMM_WORLD.Get_rank()}.pkl"
    path.write_bytes(pickle.dumps(result))


def _run_under_mpiexec(tmp: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ev.PREFIX + "S")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(SIZE), sys.executable, str(Path(__file__)), str(tmp)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(SIZE)]


@pytest.fixture(
    scope="module",
    params=["launch", "mpiexec", pytest.param("spark", marks=pytest.mark.spark)],
)
def both(request, tmp_path_factory):
    """Every rank's ``{"ops": op suite results, "mpi": MPI extras}``, per way of launching."""
    if request.param == "launch":
        return run_local(_suite_and_extras, num_proc=SIZE, backend="mpi")
    if request.param == "mpiexec":
        return _run_under_mpiexec(tmp_path_factory.mktemp("mpiexec"))
    import cloudpickle

    spark = request.getfixturevalue("spark")
    ops_module = sys.modules[_op_suite.__module__]  # executors cannot import the test modules
    cloudpickle.register_pickle_by_value(ops_module)
    try:
        return spark_estimators.run(_suite_and_extras, num_proc=SIZE, backend="mpi", spark=spark)
    finally:
        cloudpickle.unregister_pickle_by_value(ops_module)


@pytest.fixture(scope="module")
def suite(both):
    return [b["ops"] for b in both]


@pytest.fixture(scope="module")
def extras(both):
    return [b["mpi"] for b in both]


@pytest.fixture(scope="module")
def data():
    return [_rank_data(r) for r in range(SIZE)]


def test_topology_and_backend(suite):
    assert [s["topology"] for s in suite] == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)]
    assert [s["backend"] for s in suite] == ["mpi", "mpi"]
    assert all(s["is_initialized"] for s in suite)


def test_mpi_threads_supported_tells_the_truth(extras):
    for supported, multiple in (e["threads"] for e in extras):
        assert supported is multiple
    assert [e["threads"][0] for e in extras] == [True, True]  # mpi4py asks for MULTIPLE
    assert [e["mpi_enabled"] for e in extras] == [True, True]


def test_bfloat16_and_bool_reductions(extras):
    import torch

    base = torch.tensor([1.5, -2.0, 3.25] * 200, dtype=torch.bfloat16)
    expected_sum = (base * 1 + base * 2).float().numpy()
    expected_max = torch.maximum(base * 1, base * 2).float().numpy()
    for e in extras:
        np.testing.assert_array_equal(e["bf16_sum"], expected_sum)
        np.testing.assert_array_equal(e["bf16_max"], expected_max)
        expected_or = np.zeros(1000, dtype=bool)
        expected_or[:2] = True
        np.testing.assert_array_equal(e["bool_sum"], expected_or)
        np.testing.assert_array_equal(e["bool_min"], np.zeros(1000, dtype=bool))


def test_user_mpi4py_calls_mix_with_ours(extras):
    for e in extras:
        assert e["user_allreduce"] == 3
        assert e["user_bcast_from_thread"] == 1
        assert e["overlap_sum"] == 2.0


def test_init_with_a_communicator(extras):
    assert [e["reversed"] for e in extras] == [(1, 2, 1, 2), (0, 2, 0, 2)]
    assert [e["reversed_gather"] for e in extras] == [[1, 0], [1, 0]]
    assert [e["alone"] for e in extras] == [(1, 7.0), (1, 7.0)]


# -- DistributedOptimizer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    return run_local(_train, num_proc=SIZE, args=(CONFIGS,), backend="mpi")


# -- environment detection (no processes) --------------------------------------------------------
def test_mpiexec_environment_selects_mpi_without_a_rendezvous_address(monkeypatch):
    from spark_estimators.collective.runtime import settings

    for name in list(os.environ):
        if name.startswith(ev.PREFIX) or name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert settings.launched_by_mpi()
    assert settings.resolve_backend("auto") == "mpi"
    topo = settings.topology_from_env(rendezvous=False)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (1, 4, 1, 2)
    with pytest.raises(Exception, match="rendezvous point"):
        settings.topology_from_env(rendezvous=True)  # gloo under mpiexec still needs one
    monkeypatch.setenv(ev.SE_SIZE, "4")  # our launcher's variables win: not "launched by MPI"
    assert not settings.launched_by_mpi()


def test_init_comm_with_another_backend_is_refused():
    import spark_estimators.collective as hvd
    from spark_estimators.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="backend='mpi'"):
        hvd.init(backend="gloo", comm=[0])
    assert not hvd.is_initialized()


# -- failures ------------------------------------------------------------------------------------
def _raise_on_rank_1():
    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one is unhappy")
    hvd.allreduce(np.ones(100_000))  # rank 0 waits inside MPI: the launcher must stop it
    return "not reached"


def _sigkill_rank_0_inside_mpi():
    import os
    import signal

    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    hvd.barrier()
    if hvd.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(np.ones(100_000))
    return "not reached"


@pytest.mark.spark
def test_spark_run_raising_rank_fails_fast(spark):
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(_raise_on_rank_1, num_proc=2, backend="mpi", spark=spark)
    assert time.monotonic() - started < 15
    assert info.value.failed_ranks == [1]
    assert "rank one is unhappy" in info.value.worker_failures[1].traceback


@pytest.mark.spark
def test_spark_run_rank_killed_inside_mpi_fails_fast(spark):
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(_sigkill_rank_0_inside_mpi, num_proc=2, backend="mpi", spark=spark)
    assert time.monotonic() - started < 15
    assert info.value.failed_ranks == [0]
    message = info.value.worker_failures[0].message
    # Either report may arrive first: the task's (exit signal) or the PMI server's.
    assert "SIGKILL" in message or "PMI connection before MPI_Finalize" in message, message
    # The autouse fixture asserts that no rank process is left running.


def test_run_local_raising_rank_fails_fast():
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        run_local(_raise_on_rank_1, num_proc=2, backend="mpi", grace=1.0)
    assert time.monotonic() - started < 30
    assert info.value.failed_ranks == [1]


def _silent_peer():
    import signal

    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    hvd.barrier()
    if hvd.rank() == 1:  # alive, but never joins the allreduce; killed by the launcher
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        signal.sigwait({signal.SIGUSR1})
    hvd.allreduce(np.ones(4), name="lonely")
    return "not reached"


def test_silent_peer_aborts_the_job_after_the_collective_timeout():
    stderr = io.StringIO()
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        run_local(
            _silent_peer,
            num_proc=2,
            backend="mpi",
            env={ev.COLLECTIVE_TIMEOUT: "3"},
            stderr=stderr,
            grace=1.0,
        )
    elapsed = time.monotonic() - started
    assert info.value.failed_ranks == [0]
    assert 3 <= elapsed < 60
    assert "(of allreduce 'lonely') did not complete within 3 s" in stderr.getvalue()
    assert ev.COLLECTIVE_TIMEOUT in stderr.getvalue()


def test_launch_cli_with_backend_mpi(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            from mpi4py import MPI  # user code may import mpi4py first
            import spark_estimators.collective as hvd
            hvd.init()
            total = hvd.allreduce(np.ones(1) * (hvd.rank() + 1), op=hvd.Sum)
            print(f"RESULT {hvd.rank()} {hvd.size()} {MPI.COMM_WORLD.Get_size()} {total[0]}")
            hvd.shutdown()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "spark_estimators.launch", "-np", "2", "--backend", "mpi",
         str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if "RESULT" in line)
    assert lines == ["[0]RESULT 0 2 2 3.0", "[1]RESULT 1 2 2 3.0"]


if __name__ == "__main__":
    _mpiexec_main(sys.argv[1])
