"""Lazy package exports (PEP 562), so rank processes import only the modules they use.

A rank process unpickles its training spec from ``spark_estimators.<framework>.remote``; an eager
package ``__init__`` would drag in the estimator, ``pyspark.ml`` and pandas first (about a second
per rank at start-up, for code that runs only on the driver).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def require(package: str, modules: tuple[str, ...], install_hint: str) -> None:
    """Fail with the install command when one of ``modules`` is missing (without importing it)."""
    for name in modules:
        if importlib.util.find_spec(name) is None:  # pragma: no cover - depends on the install
            raise ImportError(f"{package} needs {name}: pip install '{install_hint}'")


def exports(
    package: str, table: dict[str, tuple[str, str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: name -> (module, attribute)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[0]), where[1])
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
