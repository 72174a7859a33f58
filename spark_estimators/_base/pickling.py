"""Pickling by value: what travels to executors and rank processes.

Executors and rank processes can import installed packages but not a user's own modules (a test
file, a script next to the notebook), so functions and classes from those travel by value, as
``__main__`` ones do; everything else (site-packages, the standard library, spark_estimators)
travels by reference.
"""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle


def by_value_module(fn: Any) -> Any:
    """The module of ``fn`` when it is user code that executors may not import (scripts, tests).

    Functions from installed packages (site-packages) and from spark_estimators travel by
    reference; functions of a user's own modules travel by value, as ``__main__`` ones do.
    """
    name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(name)
    if module is None or name == "__main__" or name.split(".")[0] == "spark_estimators":
        return None
    path = getattr(module, "__file__", None) or ""
    if not path or "site-packages" in path or "dist-packages" in path:
        return None
    if path.startswith(sysconfig.get_paths()["stdlib"]):
        return None
    return module


def user_modules(objects: Sequence[Any]) -> list[Any]:
    """User modules that define the given objects or their classes.

    For torch models, the classes of their sub-modules count too.
    """
    found: dict[str, Any] = {}

    def visit(obj: Any) -> None:
        for candidate in (obj, type(obj)):
            module = by_value_module(candidate)
            if module is not None:
                found[module.__name__] = module

    for obj in objects:
        if isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
            continue
        visit(obj)
        children = getattr(obj, "modules", None)  # torch.nn.Module
        if callable(children):
            try:
                for child in children():
                    visit(child)
            except TypeError:
                pass
    return list(found.values())


def dumps_by_value(obj: Any, roots: Sequence[Any] = ()) -> bytes:
    """Pickle ``obj`` with cloudpickle; user modules of ``roots`` and ``obj`` go by value.

    Executors and rank processes can import installed packages but not a user's own modules
    (a test file, a script next to the notebook), so those are pickled by value.
    """
    modules = user_modules([obj, *roots])
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(obj))
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def pickle_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle ``(fn, args, kwargs)`` with cloudpickle, by value for the user's own module of fn."""
    return dumps_by_value((fn, args, kwargs), roots=[fn])
