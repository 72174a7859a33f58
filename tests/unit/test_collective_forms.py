"""The Horovod op forms built by collective.runtime.forms behave like hand-written functions.

``allreduce_``, ``broadcast``, ... are made from one implementation per op family. A user
still pickles them by reference (``functools.partial(hvd.allreduce_, ...)`` shipped to a Spark
task, a ``multiprocessing`` target), finds them in their module (help(), pdoc, Sphinx resolve
annotations in ``inspect.getmodule(fn)``), and sees their own name.
"""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest

MODULES = ["spark_estimators.collective", "spark_estimators.collective.torch"]


def _public_functions(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    return [
        (name, getattr(module, name))
        for name in module.__all__
        if inspect.isfunction(getattr(module, name, None))
    ]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_op_pickles_by_reference(module_name: str) -> None:
    functions = _public_functions(module_name)
    assert len(functions) > 20  # the op families are there
    broken = []
    for name, fn in functions:
        try:
            same = pickle.loads(pickle.dumps(fn)) is fn
        except (pickle.PicklingError, AttributeError) as exc:
            same = False
            name = f"{name} ({type(exc).__name__})"
        if not same:
            broken.append(name)
    assert broken == []


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_op_lives_in_a_module_that_has_it(module_name: str) -> None:
    misplaced = []
    for name, fn in _public_functions(module_name):
        home = inspect.getmodule(fn)
        if home is None or getattr(home, fn.__qualname__, None) is not fn:
            misplaced.append(f"{name}: {fn.__module__}.{fn.__qualname__}")
        elif fn.__name__ != name and name not in getattr(home, "__all__", [name]):
            misplaced.append(f"{name}: named {fn.__name__}")
    assert misplaced == []
