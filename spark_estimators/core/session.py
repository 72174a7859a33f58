"""Getting a SparkSession, and facts about the cluster behind it (task slots).

The public home of these helpers; the code is in :mod:`spark_estimators._base.session`, the ground
floor, so that ``data`` and ``elastic`` can use it without importing ``core``. Code inside the
package imports from there; tests may patch the names here (what ``core.estimator`` looks up).
"""

from __future__ import annotations

from spark_estimators._base.session import (
    EMBEDDED_MASTER,
    available_task_slots,
    cancel_job_group,
    create_local_session,
    default_num_proc,
    driver_service_host,
    end_job_group,
    ensure_driver_side,
    get_spark,
    is_connect,
    spark_conf,
    spark_master,
    start_job_group,
)

__all__ = [
    "EMBEDDED_MASTER",
    "available_task_slots",
    "cancel_job_group",
    "create_local_session",
    "default_num_proc",
    "driver_service_host",
    "end_job_group",
    "ensure_driver_side",
    "get_spark",
    "is_connect",
    "spark_conf",
    "spark_master",
    "start_job_group",
]
