"""How one implementation of a collective op serves as its Horovod variants.

Horovod names each op several times: blocking and ``_async`` (a handle for ``synchronize``),
in place (``_``) and into a new buffer, one tensor and ``grouped_``. The adapters write each
op once and build the other forms with these factories; every form keeps its own name,
docstring and signature (the one shown by :func:`inspect.signature` and help()).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar, cast

from spark_estimators.collective.runtime.futures import Handle

_F = TypeVar("_F", bound=Callable[..., object])
_R = TypeVar("_R")
_X = TypeVar("_X")


def named(
    fn: _F,
    what: str,
    doc: str,
    signature: inspect.Signature | None = None,
    module: str | None = None,
) -> _F:
    """``fn`` named ``what`` and documented by ``doc`` (showing ``signature`` when given).

    ``module`` is where the form is published (default: where ``fn`` was written); pickle finds
    the function there by name, and documentation tools resolve its annotations there.
    """
    fn.__name__ = fn.__qualname__ = what
    if module is not None:
        fn.__module__ = module
    fn.__doc__ = doc
    if signature is not None:
        fn.__signature__ = signature  # type: ignore[attr-defined]
    return fn


def synchronized(
    start: Callable[..., Handle], returns: type[_R], what: str, doc: str
) -> Callable[..., _R]:
    """The blocking form of the async op ``start``: ``synchronize(start(...))``, a ``returns``."""

    def blocking(*args: object, **kwargs: object) -> _R:
        return cast("_R", start(*args, **kwargs).wait())

    signature = inspect.signature(start).replace(return_annotation=returns)
    return named(blocking, what, doc, signature, module=start.__module__)


def out_of_place(
    in_place: Callable[..., _R], copy: Callable[[_X, str], _X], what: str, doc: str
) -> Callable[..., _R]:
    """The form of ``in_place`` that leaves its first argument alone: it works on ``copy`` of it.

    ``copy(x, what)`` validates ``x`` (its errors name ``what``) and returns the new buffer(s).
    """

    def fresh(x: _X, *args: object, **kwargs: object) -> _R:
        return in_place(copy(x, what), *args, **kwargs)

    return named(fresh, what, doc, inspect.signature(in_place), module=in_place.__module__)
