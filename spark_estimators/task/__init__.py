"""What runs inside a Spark task and its rank process."""

from spark_estimators.task.context import (
    get_available_devices,
    get_device,
    get_devices,
    has_driver,
    send_event,
)

__all__ = [
    "get_available_devices",
    "get_device",
    "get_devices",
    "has_driver",
    "send_event",
]
