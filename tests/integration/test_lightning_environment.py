"""SparkClusterEnvironment maps our rank variables onto Lightning's DDP ranks (no Spark needed)."""

from __future__ import annotations

import pytest

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.strategies import DDPStrategy  # noqa: E402

from spark_estimators import envvars as ev  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.lightning import SparkClusterEnvironment  # noqa: E402


@pytest.fixture
def rank_one_of_three(monkeypatch):
    for name, value in {
        ev.SE_RANK: "1",
        ev.SE_SIZE: "3",
        ev.SE_LOCAL_RANK: "1",
        ev.SE_LOCAL_SIZE: "2",
        ev.SE_MASTER_ADDR: "10.1.2.3",
        ev.SE_MASTER_PORT: "29555",
        # torchrun's names differ on purpose: ours must win.
        ev.MASTER_PORT: "1",
        ev.RANK: "0",
    }.items():
        monkeypatch.setenv(name, value)


def test_environment_reads_our_variables(rank_one_of_three):
    env = SparkClusterEnvironment()
    assert SparkClusterEnvironment.detect()
    assert env.creates_processes_externally
    assert (env.main_address, env.main_port) == ("10.1.2.3", 29555)
    assert (env.global_rank(), env.world_size()) == (1, 3)
    # One device per rank process: each rank is a Lightning node of one device.
    assert (env.node_rank(), env.local_rank()) == (1, 0)


def test_lightning_ddp_computes_our_rank_and_world_size(rank_one_of_three):
    env = SparkClusterEnvironment()
    trainer = pl.Trainer(
        strategy=DDPStrategy(cluster_environment=env, process_group_backend="gloo"),
        accelerator="cpu",
        devices=1,
        num_nodes=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank) == (1, 3, 0)
    assert trainer.node_rank == 1 and not trainer.is_global_zero


def test_mismatched_trainer_layout_is_refused(rank_one_of_three):
    env = SparkClusterEnvironment()
    with pytest.raises(ConfigurationError, match=r"devices=1, num_nodes=3"):
        env.set_global_rank(2)
    with pytest.raises(ConfigurationError, match=r"world size of 4"):
        env.set_world_size(4)
    with pytest.raises(ConfigurationError, match=r"Trainer\(devices=2, num_nodes=3\)"):
        env.validate_settings(num_devices=2, num_nodes=3)
    env.set_global_rank(1)
    env.set_world_size(3)
    env.validate_settings(num_devices=1, num_nodes=3)


def test_outside_a_launched_rank_it_is_a_job_of_one(monkeypatch):
    for name in (ev.SE_RANK, ev.SE_SIZE, ev.RANK, ev.WORLD_SIZE):
        monkeypatch.delenv(name, raising=False)
    assert not SparkClusterEnvironment.detect()
    env = SparkClusterEnvironment()
    assert (env.global_rank(), env.world_size()) == (0, 1)
