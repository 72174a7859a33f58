"""The machinery under every Params mixin: declaring a Param, its defaults, names and docs.

- :func:`make_param` declares a class-level ``Param`` the pyspark way.
- :class:`DeclaredParams` takes each mixin's defaults from a class-level ``_defaults`` dict
  (merged along the MRO, subclasses win), so the defaults are known without an instance: the
  estimators' ``Parameters`` docs and keyword-only signatures are built from them.
- :func:`to_camel` / :func:`to_snake` map horovod's snake_case keywords to the camelCase Param
  names by rule (``num_proc`` <-> ``numProc``); :data:`ALIASES` lists exceptions (none).
- :class:`ParamGetter` declares a Param and its typed ``getX()`` in one line.
- :func:`add_accessors` gives every Param a ``getX()`` and a chainable ``setX(value)``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Mapping
from typing import ClassVar, Generic, TypeVar, overload

import pyspark
from pyspark.ml.param import Param, Params, TypeConverters


def keyword_only(init: Callable[..., None]) -> Callable[..., None]:
    """``pyspark.keyword_only`` whose refusal of positional arguments names them and the fix.

    pyspark's says only "Method __init__ forces keyword arguments."; this one says which
    positional values were given and how to pass them, e.g.
    ``TorchEstimator(model=net, optimizer=opt, loss=loss_fn)``.
    """
    inner = pyspark.keyword_only(init)

    @functools.wraps(init)
    def wrapper(self: object, *args: object, **kwargs: object) -> None:
        if args:
            cls = type(self).__name__
            given = ", ".join(f"{type(a).__name__} {_short_repr(a)}" for a in args)
            raise TypeError(
                f"{cls}() takes keyword arguments only, got {len(args)} positional "
                f"({given}): name each one, e.g. {cls}(model=net, optimizer=opt, "
                "loss=loss_fn, feature_cols=[...], label_cols=[...])"
            )
        inner(self, **kwargs)

    return wrapper


def _short_repr(value: object, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_param(
    name: str, doc: str, conv: Callable[[object], object] = TypeConverters.identity
) -> Param:
    """A Spark ML ``Param`` named ``name`` with ``doc`` and a type converter."""
    return Param(Params._dummy(), name, doc, typeConverter=conv)


T = TypeVar("T")


class ParamGetter(Generic[T]):
    """Declares a Param and becomes its typed getter: pyspark's pair in one statement.

    In a class body, ``getNumProc = ParamGetter("number of ranks", to_int_or_none)`` stands for
    pyspark's ``numProc = Param(...)`` plus ``def getNumProc(self) -> int | None`` documented
    "Gets the value of ``numProc`` or its default value.": the Param's name is the attribute's
    without ``get`` (written once), the class gets the ``Param`` (as :func:`make_param` makes
    it) under that name and a plain getter function under the attribute. The getter returns the
    converter's return type, or the type declared as
    ``getStore: ParamGetter[Store | None] = ParamGetter(doc)`` (needed for a Param without a
    converter); type checkers read it from :meth:`__get__`.

    Parameters
    ----------
    doc
        The Param's doc.
    conv
        Its type converter (default ``TypeConverters.identity``: then declare the type).
    """

    def __init__(self, doc: str, conv: Callable[[object], T] | None = None) -> None:
        self.doc = doc
        self.conv: Callable[[object], object] = TypeConverters.identity if conv is None else conv

    def __set_name__(self, owner: type, attr: str) -> None:
        name = attr[3:4].lower() + attr[4:]
        if not name or attr != _accessor("get", name):
            raise TypeError(f"a ParamGetter's attribute is get<ParamName>, not {attr!r}")
        getter = _getter(name, self._returns(owner, attr))
        getter.__module__ = owner.__module__
        getter.__qualname__ = f"{owner.__qualname__}.{attr}"
        setattr(owner, name, make_param(name, self.doc, self.conv))
        setattr(owner, attr, getter)

    def _returns(self, owner: type, attr: str) -> str:
        """The getter's return annotation: the declared type, else the converter's return type."""
        declared = vars(owner).get("__annotations__", {}).get(attr)
        if isinstance(declared, str):  # "ParamGetter[Store | None]", a postponed annotation
            return declared[declared.index("[") + 1 : declared.rindex("]")]
        if declared is not None:
            returns = typing.get_args(declared)[0]
        else:
            returns = inspect.get_annotations(self.conv).get("return", "object")
        return returns if isinstance(returns, str) else inspect.formatannotation(returns)

    @overload
    def __get__(self, obj: None, owner: type) -> Callable[[Params], T]: ...

    @overload
    def __get__(self, obj: Params, owner: type) -> Callable[[], T]: ...

    def __get__(self, obj: Params | None, owner: type) -> Callable[..., T]:
        """For type checkers only: ``__set_name__`` put the getter function in its place."""
        raise AttributeError(f"a ParamGetter ({self.doc!r}) outside a class body has no getter")


def to_int_or_none(value: object) -> int | None:
    """``TypeConverters.toInt`` that lets None through."""
    return None if value is None else TypeConverters.toInt(value)


def to_list_or_none(value: object) -> list[object] | None:
    """``TypeConverters.toList`` that lets None through."""
    return None if value is None else TypeConverters.toList(value)


def to_loss_weights(value: object) -> list[object] | dict[str, float] | None:
    """None, a list (one weight per label column) or a dict of output name -> weight.

    The dict form is Keras's, for models with named outputs; the estimator checks its keys.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"loss_weights keys must be output names (str), got {bad!r}")
        return {k: TypeConverters.toFloat(v) for k, v in value.items()}
    return TypeConverters.toList(value)


def to_str_list(value: object) -> list[str]:
    """A list of strings; a single string becomes a one-element list."""
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def to_str_or_none(value: object) -> str | None:
    """``TypeConverters.toString`` that lets None through."""
    return None if value is None else TypeConverters.toString(value)


#: The type each converter accepts, as the estimators' ``Parameters`` docs write it.
_TYPE_TEXT: dict[Callable[[object], object], str] = {
    TypeConverters.toInt: "int",
    TypeConverters.toFloat: "float",
    TypeConverters.toBoolean: "bool",
    TypeConverters.toString: "str",
    to_int_or_none: "int or None",
    to_list_or_none: "list or None",
    to_loss_weights: "list, dict or None",
    to_str_list: "list of str",
    to_str_or_none: "str or None",
    TypeConverters.toListString: "list of str",
}

# snake_case (horovod) -> camelCase (Spark ML) follows one rule: ``num_proc`` <-> ``numProc``,
# ``log_every_n_steps`` <-> ``logEveryNSteps`` (one-word names such as ``model`` are the same in
# both). A new Param therefore needs no entry anywhere but its declaration and its default.
#: snake_case keywords whose Param name does not follow the rule (none today).
ALIASES: dict[str, str] = {}
_SNAKE = {camel: snake for snake, camel in ALIASES.items()}
_UPPER = re.compile(r"(?<!^)([A-Z])")


def to_camel(name: str) -> str:
    """The Param name of a constructor keyword (``num_proc`` -> ``numProc``)."""
    if name in ALIASES:
        return ALIASES[name]
    first, *rest = name.split("_")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


def to_snake(name: str) -> str:
    """The horovod keyword of a Param name (``numProc`` -> ``num_proc``)."""
    if name in _SNAKE:
        return _SNAKE[name]
    return _UPPER.sub(lambda m: "_" + m.group(1).lower(), name)


def declared_defaults(cls: type) -> dict[str, object]:
    """The Param defaults ``cls`` declares in ``_defaults`` along its MRO (subclasses win)."""
    merged: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        merged.update(klass.__dict__.get("_defaults", {}))
    return merged


class DeclaredParams(Params):
    """Params whose defaults are declared in class-level ``_defaults`` dicts.

    Every subclass gets generated ``getX()`` / ``setX(value)`` accessors for Params that have no
    explicit one (see :func:`add_accessors`).
    """

    _defaults: ClassVar[dict[str, object]] = {}

    def __init__(self) -> None:
        super().__init__()
        # A fresh copy per instance: a default list must not be shared between stages.
        defaults = {k: copy.copy(v) for k, v in declared_defaults(type(self)).items()}
        self._setDefault(**defaults)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        add_accessors(cls)


def class_params(cls: type) -> list[Param]:
    """The Params ``cls`` declares (class attributes), sorted by name."""
    found = {p.name: p for p in (getattr(cls, n, None) for n in dir(cls)) if isinstance(p, Param)}
    return [found[name] for name in sorted(found)]


def add_accessors(cls: type) -> type:
    """Give ``cls`` a ``getX()`` and a ``setX(value)`` (returning self) for every Param ``x``.

    The pyspark.ml way (``est.setEpochs(5).setBatchSize(64)``); explicit methods win.
    """
    for name in dir(cls):
        param = getattr(cls, name, None)
        if not isinstance(param, Param) or name != param.name:
            continue
        if not hasattr(cls, _accessor("set", name)):
            setattr(cls, _accessor("set", name), _setter(name))
        if not hasattr(cls, _accessor("get", name)):
            setattr(cls, _accessor("get", name), _getter(name))
    return cls


def _accessor(prefix: str, name: str) -> str:
    """``getNumProc`` / ``setNumProc`` for the Param ``numProc``."""
    return prefix + name[0].upper() + name[1:]


def _setter(name: str) -> Callable[[Params, object], Params]:
    def setter(self: Params, value: object) -> Params:
        return self._set(**{name: value})

    setter.__name__ = _accessor("set", name)
    setter.__doc__ = f"Set the ``{name}`` param; returns self."
    return setter


def _getter(name: str, returns: str = "object") -> Callable[[Params], object]:
    def getter(self: Params) -> object:
        return self.getOrDefault(name)

    getter.__name__ = _accessor("get", name)
    getter.__doc__ = f"Gets the value of ``{name}`` or its default value."
    getter.__annotations__ = {"return": returns}
    return getter


def parameters_section(cls: type) -> str:
    """A numpydoc ``Parameters`` section naming every Param of ``cls`` by its keyword.

    Each entry is built from the Param itself (doc, type converter, declared default), so the
    docs cannot drift from the params the class really has.
    """
    defaults = declared_defaults(cls)
    lines = ["Parameters", "----------"]
    for param in class_params(cls):
        kind = _TYPE_TEXT.get(param.typeConverter, "object")
        default = defaults.get(param.name)
        lines.append(f"{to_snake(param.name)} : {kind}, default {default!r}")
        doc = param.doc[0].upper() + param.doc[1:].rstrip(".")
        text = f"{doc}. Spark ML Param ``{param.name}``."
        lines.extend(textwrap.wrap(text, 92, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


def document_constructor(cls: type, summary: str) -> type:
    """Set ``cls.__init__``'s docstring (``summary`` + Parameters) and keyword-only signature.

    ``cls`` must define its own ``__init__``. ``inspect.signature(cls)`` then lists every
    keyword the constructor takes, with its default, as ``help()`` and notebooks show it.
    """
    init = cls.__dict__["__init__"]
    target = getattr(init, "__wrapped__", init)
    text = inspect.cleandoc(summary) + "\n\n" + parameters_section(cls) + "\n"
    defaults = declared_defaults(cls)
    keywords = [
        inspect.Parameter(
            to_snake(p.name), inspect.Parameter.KEYWORD_ONLY, default=defaults.get(p.name)
        )
        for p in class_params(cls)
    ]
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *keywords]
    )
    for fn in {id(init): init, id(target): target}.values():
        fn.__doc__ = text
        fn.__signature__ = signature
    return cls
