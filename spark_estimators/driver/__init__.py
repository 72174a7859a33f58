"""The driver service: registration, rank assignment, rendezvous, results and failures."""

from spark_estimators.driver.frames import new_secret
from spark_estimators.driver.rpc import RpcClient, RpcServer
from spark_estimators.driver.service import DriverService, RankSettings, Registration, assign_ranks

__all__ = [
    "DriverService",
    "RankSettings",
    "Registration",
    "RpcClient",
    "RpcServer",
    "assign_ranks",
    "new_secret",
]
