"""run(fn) on a real local[2] SparkSession with real rank processes."""

from __future__ import annotations

import io
import os
import re
import time

import pytest

import spark_estimators
from spark_estimators.errors import ConfigurationError, TrainingFailedError

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _rank_info():
    import os

    keys = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "SPARK_ESTIMATORS_CROSS_RANK",
        "SPARK_ESTIMATORS_CROSS_SIZE",
    ]
    return {k: os.environ.get(k) for k in keys} | {"pid": os.getpid()}


@pytest.mark.parametrize("num_proc", [1, 2])
def test_results_ordered_by_rank(spark, num_proc):
    out = spark_estimators.run(_rank_info, num_proc=num_proc, spark=spark)
    assert [int(r["RANK"]) for r in out] == list(range(num_proc))
    assert {int(r["WORLD_SIZE"]) for r in out} == {num_proc}
    assert [int(r["LOCAL_RANK"]) for r in out] == list(range(num_proc))
    assert {r["SPARK_ESTIMATORS_CROSS_SIZE"] for r in out} == {"1"}
    assert len({r["pid"] for r in out}) == num_proc
    assert os.getpid() not in {r["pid"] for r in out}


def _magic(magic_number, scale=1):
    import os

    print(f"hello from rank {os.environ['RANK']}")
    return int(os.environ["RANK"]) * scale + magic_number


def test_args_kwargs_env_and_prefixed_output(spark):
    buf = io.StringIO()
    out = spark_estimators.run(
        _magic, args=(42,), kwargs={"scale": 10}, num_proc=2, spark=spark, stdout=buf
    )
    assert out == [42, 52]
    lines = buf.getvalue().splitlines()
    assert "[0]hello from rank 0" in lines
    assert "[1]hello from rank 1" in lines

    def read_env():
        import os

        return os.environ.get("MY_FLAG"), os.environ.get("HOME_NOT_COPIED_MARKER")

    os.environ["HOME_NOT_COPIED_MARKER"] = "driver-only"
    try:
        got = spark_estimators.run(read_env, num_proc=2, spark=spark, env={"MY_FLAG": "on"})
    finally:
        del os.environ["HOME_NOT_COPIED_MARKER"]
    # env= reaches every rank; the driver's own environment is not copied into ranks.
    # (In local mode the executor inherits the driver process env at JVM start, before the
    # marker was set.)
    assert got == [("on", None), ("on", None)]


def _torch_allreduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)] * 3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


def test_torchrun_env_lets_torch_distributed_allreduce(spark):
    out = spark_estimators.run(_torch_allreduce, num_proc=2, spark=spark)
    assert out == [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]


def _store_used_after_rank_0_returned():
    import os
    import time

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo", init_method="env://")
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 0:
        return "rank 0 done"  # the TCPStore lives in this process

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ", 1)[1].startswith(("Z", "X"))
        except OSError:
            return True

    deadline = time.monotonic() + 3.0  # bounded: rank 0 must still be there after this
    while not gone(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    store = distributed_c10d._get_default_store()
    store.set("late", "still served")
    return store.get("late").decode()


def test_rank_0_outlives_the_ranks_that_still_use_its_store(spark):
    # Rank 0's process hosts torch's rendezvous store: it must not exit while another rank
    # still talks to it (seen as "Connection reset by peer" on rank 1 in a notebook run).
    out = spark_estimators.run(_store_used_after_rank_0_returned, num_proc=2, spark=spark)
    assert out == ["rank 0 done", "still served"]


def _raise_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError(f"rank one is unhappy at t={time.time()!r}")
    time.sleep(120)  # rank 0 would run long: the launcher must stop it.
    return "not reached"


def test_raising_rank_fails_fast_with_traceback(spark):
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(_raise_on_rank_1, num_proc=2, spark=spark)
    # The bound counts from the moment the rank raised (not from Spark's scheduling of the job).
    raised_at = float(re.search(r"at t=([0-9.]+)", str(info.value)).group(1))
    elapsed = time.time() - raised_at
    assert elapsed < 10, f"took {elapsed:.1f}s"
    err = info.value
    assert err.failed_ranks == [1]
    assert "rank one is unhappy" in err.worker_failures[1].traceback
    assert "_raise_on_rank_1" in err.worker_failures[1].traceback
    assert "rank 1 on host" in str(err)
    # The error survives pickling with its failures (it crosses processes in notebooks/tools).
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert again.failed_ranks == [1] and str(again) == str(err)


def _kill_self_on_rank_0():
    import os
    import time

    if os.environ["RANK"] == "0":
        print(f"KILLING AT {time.time()!r}", flush=True)
        os.kill(os.getpid(), 9)
    time.sleep(120)


def test_sigkilled_rank_fails_fast_no_leftovers(spark):
    buf = io.StringIO()
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(_kill_self_on_rank_0, num_proc=2, spark=spark, stdout=buf)
    killed_at = float(re.search(r"KILLING AT ([0-9.]+)", buf.getvalue()).group(1))
    assert time.time() - killed_at < 10
    failure = info.value.worker_failures[0]
    assert "SIGKILL" in failure.message
    assert failure.exit_code == -9
    # The autouse fixture asserts no rank process is left running.


def test_num_proc_over_slots_fails_in_driver_fast(spark):
    start = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"num_proc=3 .* has 2") as info:
        spark_estimators.run(_rank_info, num_proc=3, spark=spark)
    assert time.monotonic() - start < 30
    assert "local[3]" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_proc": 0}, "num_proc must be a positive int"),
        ({"num_proc": 2, "backend": "tcp"}, "backend='tcp' is not one of"),
        ({"num_proc": 2, "env": {"A": 1}}, "env must map str to str"),
        ({"num_proc": 2, "start_timeout": -1}, "start_timeout must be > 0"),
        ({"num_proc": 2, "use_mpi": True, "use_gloo": True}, "conflict"),
    ],
)
def test_bad_arguments(spark, kwargs, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        spark_estimators.run(_rank_info, spark=spark, **kwargs)


def test_run_after_failure_still_works(spark):
    """A failed job leaves the session usable (no stuck barrier stage, no stale service)."""
    with pytest.raises(TrainingFailedError):
        spark_estimators.run(_raise_on_rank_1, num_proc=2, spark=spark)
    assert spark_estimators.run(_magic, args=(1,), num_proc=2, spark=spark) == [1, 2]


def test_rendezvous_timeout_names_who_registered(spark):
    """With one of two slots busy, the barrier job cannot start: RendezvousTimeoutError."""
    import threading

    from spark_estimators.errors import RendezvousTimeoutError

    sc = spark.sparkContext
    started = threading.Event()

    def block_until_cancelled(batches):
        # Defined here so that cloudpickle ships it by value (test modules are not importable
        # in the Python workers).
        import time

        for batch in batches:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # holds a task slot until the job is cancelled
                time.sleep(0.2)
            yield batch

    def blocker():
        sc.setJobGroup("blocker", "holds one slot", interruptOnCancel=True)
        started.set()
        try:
            spark.range(1, numPartitions=1).mapInArrow(block_until_cancelled, "id long").collect()
        except Exception:
            pass

    thread = threading.Thread(target=blocker, daemon=True)
    thread.start()
    started.wait(10)
    tracker = sc.statusTracker()
    deadline = time.monotonic() + 120

    def blocker_running() -> bool:
        infos = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
        return any(info is not None and info.numActiveTasks >= 1 for info in infos)

    while not blocker_running() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the scheduler until the blocker's task holds its slot
    assert blocker_running(), "the blocker task never started"
    try:
        t0 = time.monotonic()
        with pytest.raises(
            RendezvousTimeoutError,
            match=r"of 2 Spark tasks registered within "
            r"start_timeout=3s",
        ) as info:
            spark_estimators.run(_rank_info, num_proc=2, spark=spark, start_timeout=3)
        assert 3 <= time.monotonic() - t0 < 15
        assert info.value.expected == 2
        assert len(info.value.registered) < 2
    finally:
        sc.cancelJobGroup("blocker")
        thread.join(30)
    # The session is usable again once the slot is free.
    assert spark_estimators.run(_magic, args=(5,), num_proc=2, spark=spark) == [5, 6]


def _return_a_lock():
    import threading

    return {"step": 3, "lock": threading.Lock()}


def _return_a_generator():
    return (i for i in range(3))


@pytest.mark.parametrize(
    ("fn", "names"),
    [
        (_return_a_lock, "fn's return value (a dict) cannot be pickled to send it to the driver: "
         "fn's return value['lock'] is a _thread.lock"),
        (_return_a_generator, "fn's return value cannot be pickled to send it to the driver: "
         "fn's return value is a generator"),
    ],
)  # fmt: skip
def test_an_unpicklable_return_value_is_named(spark, fn, names):
    """Pickle's own "cannot pickle '_thread.lock' object" reads as if fn had failed (issue 41)."""
    with pytest.raises(TrainingFailedError) as info:
        spark_estimators.run(fn, num_proc=1, spark=spark)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"TypeError: {names} (TypeError: cannot pickle"), first
    assert "Return plain data" in first
