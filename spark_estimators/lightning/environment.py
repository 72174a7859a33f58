"""Lightning ``ClusterEnvironment`` for rank processes started by spark_estimators.

Every rank of :func:`spark_estimators.run` (and so of :class:`LightningEstimator`) is one process
that drives exactly one device: the task's GPU (``devices=[get_device()'s index]``) or the CPU.
Lightning is told so with ``Trainer(num_nodes=world_size)``: each rank is a "node" of one device,
so Lightning's ``node_rank * devices + local_rank`` is our global rank. The rendezvous point is the
one our driver assigned (``SPARK_ESTIMATORS_MASTER_ADDR`` / ``_PORT``, a port that rank 0's task
holds for it on its host); Lightning's DDP strategy creates the ``torch.distributed`` group there.

>>> from pytorch_lightning import Trainer  # doctest: +SKIP
>>> env = SparkClusterEnvironment()  # doctest: +SKIP
>>> trainer = Trainer(strategy=DDPStrategy(cluster_environment=env), devices=1,
...                   num_nodes=env.world_size())  # doctest: +SKIP
"""

from __future__ import annotations

import os

from lightning_fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning_fabric.utilities.rank_zero import rank_zero_only

from spark_estimators import envvars as ev
from spark_estimators.errors import ConfigurationError


class SparkClusterEnvironment(ClusterEnvironment):
    """Rank, world size and rendezvous point from the variables our launcher sets.

    ``local_rank()`` is always 0 and ``node_rank()`` is the global rank: a rank process owns one
    device (see the module docstring). Outside a launched rank (no ``SPARK_ESTIMATORS_RANK``) the
    process is a job of one on ``127.0.0.1``.
    """

    def __init__(self) -> None:
        super().__init__()
        from spark_estimators.collective.runtime.settings import topology_from_env

        self._topology = topology_from_env()

    @property
    def creates_processes_externally(self) -> bool:
        """True: the Spark tasks start the rank processes, Lightning must not spawn any."""
        # The Spark tasks start the rank processes; Lightning must not spawn any.
        return True

    @property
    def main_address(self) -> str:
        """The rendezvous host (rank 0's)."""
        return str(self._topology.master_addr)

    @property
    def main_port(self) -> int:
        """The rendezvous port."""
        return int(self._topology.master_port)

    @staticmethod
    def detect() -> bool:
        """True inside a rank process started by spark_estimators."""
        return ev.SE_RANK in os.environ and ev.SE_SIZE in os.environ

    def world_size(self) -> int:
        """The number of ranks spark_estimators started."""
        return int(self._topology.size)

    def set_world_size(self, size: int) -> None:
        """Accept Lightning's world size only when it equals ours; raise otherwise."""
        ours = self.world_size()
        self._must_match(
            size, ours, f"a world size of {size} but spark_estimators started {ours} ranks"
        )

    def global_rank(self) -> int:
        """The rank of this process."""
        return int(self._topology.rank)

    def set_global_rank(self, rank: int) -> None:
        """Accept Lightning's global rank only when it equals ours; raise otherwise."""
        ours = self.global_rank()
        self._must_match(rank, ours, f"global rank {rank} but this process is rank {ours}")
        rank_zero_only.rank = rank  # type: ignore[attr-defined]

    def _must_match(self, theirs: int, ours: int, computed: str) -> None:
        """Raise when Lightning's view (``theirs``) of the job differs from ours."""
        if theirs != ours:
            raise ConfigurationError(
                f"Lightning computed {computed}: use "
                f"Trainer(devices=1, num_nodes={self.world_size()})"
            )

    def local_rank(self) -> int:
        """Always 0: each rank process sees only its own device (``cuda:0``)."""
        return 0

    def node_rank(self) -> int:
        """The global rank: each rank process counts as one node of one device."""
        return self.global_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise unless the Trainer asks for one device per node and one node per rank."""
        if num_devices != 1 or num_nodes != self.world_size():
            raise ConfigurationError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) does not match the "
                f"{self.world_size()} rank processes of this job, each driving one device: use "
                f"Trainer(devices=1, num_nodes={self.world_size()})"
            )
