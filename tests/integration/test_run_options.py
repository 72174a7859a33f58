"""Horovod's run()/run_elastic() arguments: the supported ones work on real ranks, the others
fail in the driver before any Spark job with an error naming the alternative."""

from __future__ import annotations

import json

import pytest

import spark_estimators
from spark_estimators import envvars as ev
from spark_estimators import run_options
from spark_estimators.errors import ConfigurationError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_unsupported_arguments_name_the_alternative():
    with pytest.raises(
        ConfigurationError, match=r"run\(extra_mpi_args='-x FOO'\).*env=.*MPIR_CVAR"
    ):
        run_options.check_unsupported("run", extra_mpi_args="-x FOO")
    with pytest.raises(ConfigurationError, match=r"executable=.*spark\.pyspark\.python"):
        run_options.check_unsupported("run", executable="/usr/bin/python3")
    run_options.check_unsupported("run", extra_mpi_args=None, executable="")  # unset: fine


def test_nics_and_timeline_become_rank_variables():
    env = run_options.rank_env({"A": "1"}, nics=["eth0", "eth1"], timeline="/tmp/t.json")
    assert env == {"A": "1", "GLOO_SOCKET_IFNAME": "eth0,eth1", "NCCL_SOCKET_IFNAME": "eth0,eth1",
                   ev.TIMELINE: "/tmp/t.json"}  # fmt: skip
    assert run_options.rank_env(None, nics="lo") == {"GLOO_SOCKET_IFNAME": "lo",
                                                     "NCCL_SOCKET_IFNAME": "lo"}  # fmt: skip
    assert run_options.rank_env({"A": "1"}) == {"A": "1"}
    for bad in ([], [""], ["a,b"], [3]):
        with pytest.raises(ConfigurationError, match="network interface name"):
            run_options.rank_env(None, nics=bad)


def test_elastic_arguments_map_horovods_names():
    args, kwargs = run_options.elastic_arguments((print,), {"min_np": 1, "max_np": 3, "np": 2})
    assert args == (print,)
    assert kwargs == {"min_num_proc": 1, "max_num_proc": 3, "num_proc": 2}
    # positional num_proc and env stay where they are; nics goes into the positional env
    args, kwargs = run_options.elastic_arguments(
        (print, (), None, 2, 1, 2, 60, 600, 3, {"A": "1"}), {"np": 2, "nics": "lo"}
    )
    assert args[3] == 2 and args[9] == {"A": "1", "GLOO_SOCKET_IFNAME": "lo",
                                        "NCCL_SOCKET_IFNAME": "lo"}  # fmt: skip
    assert kwargs == {}


def test_run_elastic_refuses_before_starting_anything():
    with pytest.raises(ConfigurationError, match="min_np=2 and min_num_proc=1 disagree"):
        spark_estimators.run_elastic(print, num_proc=2, min_np=2, min_num_proc=1)
    with pytest.raises(ConfigurationError, match=r"run_elastic\(extra_mpi_args="):
        spark_estimators.run_elastic(print, num_proc=2, extra_mpi_args="--bind-to none")
    with pytest.raises(ConfigurationError, match="prefix_output_with_timestamp=True.*log format"):
        spark_estimators.run_elastic(print, num_proc=2, prefix_output_with_timestamp=True)
    # Horovod's default (False) is what run_elastic does: accepted
    _, kwargs = run_options.elastic_arguments((print,), {"prefix_output_with_timestamp": False})
    assert kwargs == {}


def _allreduce_and_env() -> dict:
    import os

    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    hvd.shutdown()
    return {"sum": float(total[0]), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


@pytest.mark.spark
def test_run_with_nics_and_timeline(spark, tmp_path):
    out = spark_estimators.run(
        _allreduce_and_env, num_proc=2, spark=spark, nics=["lo"],
        timeline=str(tmp_path / "tl.json"),
    )  # fmt: skip
    assert out == [{"sum": 3.0, "ifname": "lo"}] * 2  # gloo ran over the loopback interface
    for rank in (0, 1):
        with open(tmp_path / f"tl.rank{rank}.json", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        assert {e["pid"] for e in events} == {rank}
        assert [e["name"] for e in events if e["ph"] == "X"][-2:] == [
            "NEGOTIATE_ALLREDUCE", "ALLREDUCE",
        ]  # fmt: skip


@pytest.mark.spark
def test_run_refuses_extra_mpi_args_before_any_job(spark):
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup(None))
    with pytest.raises(ConfigurationError, match="there is no mpirun"):
        spark_estimators.run(print, num_proc=2, spark=spark, extra_mpi_args="-x NCCL_DEBUG=INFO")
    assert set(tracker.getJobIdsForGroup(None)) == before
