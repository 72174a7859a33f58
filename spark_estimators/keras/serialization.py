"""A Keras model and optimizer as bytes and recipes that travel to the ranks and back.

The model travels as ``.keras`` archive bytes; the optimizer as a ``(class, config)`` recipe that
every rank rebuilds with fresh state (:func:`optimizer_from_recipe`).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import keras

from spark_estimators.task.scratch import make_temp_dir


def model_to_bytes(model: Any) -> bytes:
    """The model as ``.keras`` archive bytes."""
    tmp = make_temp_dir("se-keras-")
    try:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_from_bytes(
    data: bytes, custom_objects: dict[str, Any] | None, compile: bool = True
) -> Any:
    """Load ``.keras`` bytes; ``safe_mode`` is off because the model is the user's own."""
    tmp = make_temp_dir("se-keras-")
    try:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(
            path, custom_objects=custom_objects or None, compile=compile, safe_mode=False
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def optimizer_recipe(optimizer: Any) -> tuple[type, dict[str, Any]]:
    """``(class, config)`` that rebuilds ``optimizer`` (fresh state) with ``cls.from_config``.

    Schedules and wrapped optimizers stay objects (pickled), so custom ones need no
    ``custom_objects``.
    """
    config = dict(optimizer.get_config())
    lr = getattr(optimizer, "_learning_rate", None)
    if lr is not None and "learning_rate" in config and not hasattr(lr, "assign"):
        config["learning_rate"] = lr
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and "inner_optimizer" in config:
        config["inner_optimizer"] = ("__recipe__", optimizer_recipe(inner))
    return type(optimizer), config


def optimizer_from_recipe(recipe: tuple[Any, dict[str, Any]]) -> Any:
    """A fresh optimizer from :func:`optimizer_recipe`'s ``(class, config)``."""
    cls, config = recipe
    config = dict(config)
    inner = config.get("inner_optimizer")
    if isinstance(inner, tuple) and inner and inner[0] == "__recipe__":
        config.pop("inner_optimizer")
        return cls(optimizer_from_recipe(inner[1]), **config)  # LossScaleOptimizer
    return cls.from_config(config)


def scale_learning_rate(optimizer: Any, factor: float) -> None:
    """Multiply the optimizer's learning rate variable by ``factor`` (in place)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    lr = target._learning_rate
    if not hasattr(lr, "assign"):
        raise TypeError("scale_lr needs a constant learning rate, not a schedule")
    lr.assign(lr * factor)
