"""A Keras model and optimizer as bytes and recipes that travel to the ranks and back.

The model travels as ``.keras`` archive bytes; the optimizer as a ``(class, config)`` recipe that
every rank rebuilds with fresh state (:func:`optimizer_from_recipe`).

Custom objects: the driver finds what the model, its loss and its metrics need the way Keras
finds them (:func:`find_custom_objects`): objects registered with
``keras.saving.register_keras_serializable`` (under their ``"package>name"`` key and their
plain name), the functions, classes and objects passed as ``loss``/``metrics``, and classes or
functions named by the model's config that are defined in a module the driver has imported
(a notebook's ``__main__``, a script, a test file; Keras writes no module for ``__main__``
classes, which are looked up there). They travel by value with the user's own
``custom_objects`` (which win on a clash); each rank registers the ``"package>name"`` ones
again (:func:`register_shipped_objects`), so the archives it writes name them as the driver did.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import types
import zipfile
from collections.abc import Mapping

import keras

from spark_estimators.task.scratch import make_temp_dir

#: ``(optimizer class, config)``: how an optimizer travels (:func:`optimizer_recipe`).
OptimizerRecipe = tuple[type[keras.optimizers.Optimizer], dict[str, object]]


def model_to_bytes(model: keras.Model, compile_state: bool = True) -> bytes:
    """The model as ``.keras`` archive bytes (``compile_state=False``: without loss/metrics)."""
    tmp = make_temp_dir("se-keras-")
    shadowed = not compile_state and "get_compile_config" not in vars(model)
    if shadowed:
        model.get_compile_config = _no_compile_config
    try:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        if shadowed:
            del model.get_compile_config
        shutil.rmtree(tmp, ignore_errors=True)


def _no_compile_config() -> None:
    return None


def drop_unsaveable_compile_state(model: keras.Model) -> str | None:
    """Make a compiled model save without its compile state when that cannot be saved.

    A loss or metric Keras cannot serialize (a ``functools.partial``, a callable object
    without ``get_config``) would fail every ``model.save`` after training; instead the model
    saves without it and comes back uncompiled. Returns why, or None when nothing was dropped.
    """
    try:
        model.get_compile_config()
    except (TypeError, ValueError) as exc:
        model.get_compile_config = _no_compile_config
        return f"{type(exc).__name__}: {exc}"
    return None


def model_from_bytes(
    data: bytes, custom_objects: Mapping[str, object] | None, compile: bool = True
) -> keras.Model:
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


def find_custom_objects(model_bytes: bytes | None, *objects: object) -> dict[str, object]:
    """The custom objects needed to load ``model_bytes`` and ``objects`` (loss, metrics).

    Keys are the names the ``.keras`` config looks up: ``"package>name"`` for a registered
    object, also its plain name (a rank that saved it unregistered writes that one).
    Keras's own objects are left out (Keras finds them itself).

    >>> def my_loss(y_true, y_pred):
    ...     return y_pred
    >>> sorted(find_custom_objects(None, my_loss, ["mae"]))
    ['my_loss']
    """
    found: dict[str, object] = {}
    for obj in objects:
        _passed_objects(obj, found)
    if model_bytes:
        with zipfile.ZipFile(io.BytesIO(model_bytes)) as archive:
            config = json.loads(archive.read("config.json"))
        _config_objects(config, found)
    return found


def _is_keras_own(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "keras" or module.startswith("keras.")


def _add(found: dict[str, object], key: str, obj: object) -> None:
    if obj is None or _is_keras_own(obj):
        return
    keys = [key, key.split(">", 1)[-1]]
    plain = getattr(obj, "__name__", None)
    if isinstance(plain, str):
        keys.append(plain)
    for name in keys:
        found.setdefault(name, obj)


def _passed_objects(value: object, found: dict[str, object]) -> None:
    """Custom objects among a ``loss``/``metrics`` value (nested lists and dicts)."""
    if isinstance(value, dict):
        for item in value.values():
            _passed_objects(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _passed_objects(item, found)
    elif isinstance(value, str):
        _add(found, value, keras.saving.get_registered_object(value))
    elif isinstance(value, types.FunctionType | type):
        _add(found, keras.saving.get_registered_name(value), value)
    elif hasattr(value, "get_config"):  # a Loss or Metric object: Keras loads it by its class
        _add(found, keras.saving.get_registered_name(type(value)), type(value))


def _config_objects(config: object, found: dict[str, object]) -> None:
    """Custom classes and functions named in a ``.keras`` config (walked recursively)."""
    if isinstance(config, list):
        for item in config:
            _config_objects(item, found)
        return
    if not isinstance(config, dict):
        return
    for item in config.values():
        _config_objects(item, found)
    module, class_name = config.get("module"), config.get("class_name")
    if module is None and isinstance(class_name, str) and "config" in config:
        # Keras writes no module for a class defined in __main__ (a notebook, a script).
        module = "__main__"
    if not isinstance(module, str) or not isinstance(class_name, str):
        return
    if module in ("keras", "builtins") or module.startswith("keras."):
        return
    if class_name == "function":
        name = config.get("config")
    else:
        name = config.get("registered_name") or class_name
    if not isinstance(name, str) or name in found:
        return
    obj = keras.saving.get_registered_object(name)
    if obj is None:
        # Unregistered: the class or function as its defining module (already imported here,
        # never imported by us) holds it.
        candidate = vars(sys.modules[module]).get(name) if module in sys.modules else None
        if getattr(candidate, "__module__", None) == module and callable(candidate):
            obj = candidate
    _add(found, name, obj)


def register_shipped_objects(custom_objects: Mapping[str, object]) -> None:
    """Register ``"package>name"`` entries of shipped custom objects (on a rank).

    Their registration does not travel with them (the decorator ran in the driver); after this
    the rank saves them under their registered names again. Names that are taken are left.
    """
    for key, obj in custom_objects.items():
        if ">" not in key or keras.saving.get_registered_object(key) is not None:
            continue
        package, name = key.split(">", 1)
        try:
            keras.saving.register_keras_serializable(package=package, name=name)(obj)
        except ValueError:  # a class without get_config(): it loads through custom_objects
            continue


def optimizer_recipe(optimizer: keras.optimizers.Optimizer) -> OptimizerRecipe:
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


def optimizer_from_recipe(recipe: OptimizerRecipe) -> keras.optimizers.Optimizer:
    """A fresh optimizer from :func:`optimizer_recipe`'s ``(class, config)``."""
    cls, config = recipe
    config = dict(config)
    inner = config.get("inner_optimizer")
    if isinstance(inner, tuple) and inner and inner[0] == "__recipe__":
        config.pop("inner_optimizer")
        return cls(optimizer_from_recipe(inner[1]), **config)  # LossScaleOptimizer
    return cls.from_config(config)


def scale_learning_rate(optimizer: keras.optimizers.Optimizer, factor: float) -> None:
    """Multiply the optimizer's learning rate variable by ``factor`` (in place)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    lr = target._learning_rate
    if not hasattr(lr, "assign"):
        raise TypeError("scale_lr needs a constant learning rate, not a schedule")
    lr.assign(lr * factor)
