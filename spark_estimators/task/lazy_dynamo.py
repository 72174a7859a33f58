"""Defer ``import torch._dynamo`` in a rank process until something really needs TorchDynamo.

Why: importing ``torch._dynamo`` costs about 1.3 s of CPU here (sympy, torch.fx, inductor
modules), as much as ``import torch`` itself, and eager training pulls it in only for
no-ops. torch's optimizers decorate ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` with ``torch._disable_dynamo`` (whose wrapper runs
``torch._dynamo.disable(fn, recursive, wrapping=False)`` on first call) and wrap ``step`` in
``_use_grad_for_differentiable`` (which runs ``import torch._dynamo`` and
``torch._dynamo.graph_break()`` on every step). Outside ``torch.compile`` both are no-ops, and
nothing can be compiling before ``torch._dynamo`` is loaded: ``torch.compile`` needs it.

How: :func:`install` puts an import hook in ``sys.meta_path`` that answers the first
``import torch._dynamo`` with a small stand-in module. The stand-in serves what eager code uses
without TorchDynamo: ``graph_break()`` does nothing, ``disable(fn, recursive, wrapping=False)``
(torch's internal call) returns a wrapper that calls ``fn``, and
``trace_rules.clear_lru_cache()`` (``init_process_group`` calls it when ``torch._dynamo`` is in
``sys.modules``) has no cache to clear. Any other use --
``torch.compile``, ``torch._dynamo.reset``, ``torch.export``, a submodule import, ``disable``
called by user code -- loads the real ``torch._dynamo`` first, and from then on everything is
TorchDynamo's own: the stand-in forwards every name to it, ``torch._dynamo`` and
``sys.modules`` hold the real module, and each function that got a stand-in wrapper gets the
real ``torch._dynamo.disable`` result instead (the attribute ``_disable_dynamo`` caches), so
compiled code sees the same disabled functions as in a process that imported TorchDynamo up
front. The stand-in wrappers also carry the ``_torchdynamo_disable`` markers TorchDynamo looks
for.

Only rank processes install it (:mod:`spark_estimators.task.child`);
``SPARK_ESTIMATORS_LAZY_DYNAMO=0`` in the rank environment (``env=``) turns it off.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from spark_estimators import envvars as ev

TARGET = "torch._dynamo"
_DISABLE_ATTR = "__dynamo_disable"  # the attribute torch._compile._disable_dynamo caches on fn

_lock = threading.RLock()
_real: types.ModuleType | None = None
_loading = False
_deferred: list[tuple[Callable[..., Any], bool]] = []


def real_module() -> types.ModuleType | None:
    """The real ``torch._dynamo`` when it has been loaded through the stand-in, else None."""
    return _real


def _is_stand_in(module: object) -> bool:
    return bool(getattr(module, "__dict__", {}).get("__se_stand_in__"))


def _load_real() -> types.ModuleType:
    """Import the real ``torch._dynamo`` in place of the stand-in and hand it the deferred work.

    No lock of ours is held while importing: the import system's own module lock makes other
    threads wait for the import, and hands this thread the partly initialised module when
    torch's circular imports come back to ``torch._dynamo`` (what they would get anyway).
    """
    global _loading
    real = _real
    if real is not None:
        return real
    _loading = True  # from now on the finder steps aside
    current = sys.modules.get(TARGET)
    if current is not None and _is_stand_in(current):
        with _lock:
            if sys.modules.get(TARGET) is current:
                del sys.modules[TARGET]
    module = importlib.import_module(TARGET)
    if getattr(module.__spec__, "_initializing", False):
        return module  # re-entered from inside its own import: finish in the outer call
    return _finish(module)


def _finish(real: types.ModuleType) -> types.ModuleType:
    global _real
    with _lock:
        if _real is None:
            torch = sys.modules["torch"]
            torch._dynamo = real  # type: ignore[attr-defined]  # also where it was the stand-in
            for fn, recursive in _deferred:
                setattr(fn, _DISABLE_ATTR, real.disable(fn, recursive, wrapping=False))
            _deferred.clear()
            _real = real
        return _real


def _graph_break(msg: str = "") -> None:
    real = _real
    if real is not None:
        real.graph_break(msg)


def _deferred_disable(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    """Stand-in for ``torch._dynamo.disable(fn, recursive, wrapping=False)``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        real = _real
        if real is None:
            return fn(*args, **kwargs)
        # Loaded since this wrapper was handed out: use what TorchDynamo made of fn.
        return getattr(fn, _DISABLE_ATTR)(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    call._torchdynamo_disable_recursive = recursive  # type: ignore[attr-defined]
    call._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    with _lock:
        if _real is not None:
            return _real.disable(fn, recursive, wrapping=False)  # type: ignore[no-any-return]
        _deferred.append((fn, recursive))
    return call


def _disable(
    fn: Callable[..., Any] | None = None,
    recursive: bool = True,
    *,
    reason: str | None = None,
    wrapping: bool = True,
) -> Any:
    if _real is None and fn is not None and not wrapping and reason is None:
        return _deferred_disable(fn, recursive)
    return _load_real().disable(fn, recursive, reason=reason, wrapping=wrapping)


class _TraceRules:
    """``torch._dynamo.trace_rules`` as ``init_process_group`` touches it.

    torch.distributed clears TorchDynamo's trace-rule caches when ``torch._dynamo`` is in
    ``sys.modules``; before the real module is loaded nothing was traced, so nothing is cached.
    Any other name is the real module's.
    """

    def clear_lru_cache(self) -> None:
        real = _real
        if real is not None:
            real.trace_rules.clear_lru_cache()

    def __getattr__(self, name: str) -> Any:
        return getattr(_load_real().trace_rules, name)


def _module_getattr(name: str) -> Any:
    return getattr(_load_real(), name)


def _make_stand_in(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    module = types.ModuleType(TARGET, "Stand-in for torch._dynamo (see spark_estimators.task).")
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__package__ = TARGET
    module.__dict__.update(
        {
            "__se_stand_in__": True,  # read by _is_stand_in
            "graph_break": _graph_break,
            "disable": _disable,
            "trace_rules": _TraceRules(),
        }
    )
    return module


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _make_stand_in(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # Set here, not in create_module: the import system probes optional attributes
        # (``__path__``, ``__file__``) in between, and a probe must not load TorchDynamo.
        module.__getattr__ = _module_getattr  # type: ignore[method-assign]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET or _loading or _real is not None:
            return None
        return importlib.machinery.ModuleSpec(TARGET, _StandInLoader())


_FINDER = _Finder()


def enabled() -> bool:
    """False when ``SPARK_ESTIMATORS_LAZY_DYNAMO`` is ``0``/``false``/``no``."""
    return ev.env_on(ev.LAZY_DYNAMO)


def install() -> bool:
    """Answer the first ``import torch._dynamo`` with the stand-in; True when installed.

    Does nothing (False) when turned off or when ``torch._dynamo`` is already imported.
    """
    if not enabled() or TARGET in sys.modules:
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    """Remove the import hook (a stand-in already handed out keeps working)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
