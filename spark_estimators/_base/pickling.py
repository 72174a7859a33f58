"""Pickling by value: what travels to executors and rank processes.

Executors and rank processes can import installed packages but not a user's own modules (a test
file, a script next to the notebook), so functions and classes from those travel by value, as
``__main__`` ones do; everything else (site-packages, the standard library, spark_estimators)
travels by reference. The user modules found are those defining the travelling objects or
their classes and those their code reads: a ``helpers.py`` next to the notebook, imported from
``sys.path`` and called from a ``__main__`` model's ``forward`` or wrapped in a
``functools.partial``, travels by value too (see :class:`_ModuleFinder`).
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from collections.abc import Callable, Sequence
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import cloudpickle

_MAX_DEPTH = 40


def by_value_module(fn: Any) -> Any:
    """The module of ``fn`` when it is user code that executors may not import (scripts, tests).

    Functions from installed packages (site-packages) and from spark_estimators travel by
    reference; functions of a user's own modules travel by value, as ``__main__`` ones do.
    ``fn`` may also be a module object.
    """
    if isinstance(fn, ModuleType):
        name = fn.__name__
    else:
        name = getattr(fn, "__module__", None) or ""
        if not isinstance(name, str):
            return None
    module = sys.modules.get(name)
    if module is None or name == "__main__" or name.split(".")[0] == "spark_estimators":
        return None
    path = getattr(module, "__file__", None) or ""
    if not path or "site-packages" in path or "dist-packages" in path:
        return None
    if path.startswith(sysconfig.get_paths()["stdlib"]):
        return None
    return module


def _code_names(code: CodeType) -> set[str]:
    """The global names a code object (and the functions nested in it) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


class _ModuleFinder:
    """Walks the objects that travel and the code they reference, collecting user modules.

    Besides the objects themselves and their classes, it follows what cloudpickle will pickle
    by value: the globals read by ``__main__`` and user-module functions and methods (a helper
    module imported next to the notebook, ``import helpers`` or ``from helpers import f``),
    ``functools.partial`` (its function, arguments and keywords), bound methods, closures,
    containers, the attributes of instances of user classes and torch sub-modules.
    """

    def __init__(self) -> None:
        self.found: dict[str, Any] = {}
        self._seen: set[int] = set()

    def _user(self, obj: Any) -> bool:
        """True when ``obj`` is defined in ``__main__`` or a user module (so it goes by value)."""
        module = by_value_module(obj)
        if module is not None:
            self.found.setdefault(module.__name__, module)
            return True
        return getattr(obj, "__module__", None) == "__main__"

    def visit(self, obj: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH or id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        deeper = depth + 1
        if isinstance(obj, ModuleType):
            if by_value_module(obj) is not None:
                self.found.setdefault(obj.__name__, obj)
                for value in list(vars(obj).values()):  # pickled whole, by value
                    self.visit(value, deeper)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                self.visit(item, deeper)
        elif isinstance(obj, list | tuple | set | frozenset):
            for item in obj:
                self.visit(item, deeper)
        elif isinstance(obj, dict):
            for item in list(obj.values()):
                self.visit(item, deeper)
        elif isinstance(obj, FunctionType):
            self._visit_function(obj, deeper)
        elif isinstance(obj, MethodType):
            self.visit(obj.__func__, deeper)
            self.visit(obj.__self__, deeper)
        elif isinstance(obj, type):
            if self._user(obj):
                for value in list(vars(obj).values()):
                    for part in (value, *_wrapped(value)):
                        self.visit(part, deeper)
                for base in obj.__bases__:
                    self.visit(base, deeper)
        else:
            self.visit(type(obj), deeper)
            if self._user(type(obj)):
                state = getattr(obj, "__dict__", None)
                if isinstance(state, dict):
                    self.visit(state, deeper)
            children = getattr(obj, "modules", None)  # torch.nn.Module (e.g. an nn.Sequential)
            if callable(children) and hasattr(obj, "named_parameters"):
                try:
                    for child in children():
                        self.visit(child, deeper)
                except TypeError:
                    pass

    def _visit_function(self, fn: FunctionType, depth: int) -> None:
        if not self._user(fn):
            return
        glob = fn.__globals__
        for name in _code_names(fn.__code__):
            if name in glob:
                self.visit(glob[name], depth)
        for cell in fn.__closure__ or ():
            try:
                self.visit(cell.cell_contents, depth)
            except ValueError:  # an empty cell
                pass
        for default in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            self.visit(default, depth)


def _wrapped(value: Any) -> tuple[Any, ...]:
    """The functions inside a class attribute (staticmethod, classmethod, property)."""
    if isinstance(value, staticmethod | classmethod):
        return (value.__func__,)
    if isinstance(value, property):
        return tuple(f for f in (value.fget, value.fset, value.fdel) if f is not None)
    return ()


def user_modules(objects: Sequence[Any]) -> list[Any]:
    """User modules that define the given objects, their classes, or code they reference.

    For torch models, the classes of their sub-modules count too; see :class:`_ModuleFinder`
    for what else is followed (e.g. a helper module a ``__main__`` model's ``forward`` calls).
    """
    finder = _ModuleFinder()
    for obj in objects:
        finder.visit(obj)
    return list(finder.found.values())


def dumps_by_value(obj: Any, roots: Sequence[Any] = ()) -> bytes:
    """Pickle ``obj`` with cloudpickle; user modules of ``roots`` and ``obj`` go by value.

    Executors and rank processes can import installed packages but not a user's own modules
    (a test file, a script next to the notebook), so those are pickled by value.
    """
    # Only the modules registered here are unregistered after: one the caller registered
    # itself (``cloudpickle.register_pickle_by_value``) stays registered.
    registered: set[str] = getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", set())
    modules = [m for m in user_modules([obj, *roots]) if m.__name__ not in registered]
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
