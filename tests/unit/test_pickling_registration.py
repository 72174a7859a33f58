"""dumps_by_value registers a user's module only for its own pickling and leaves the caller's
registrations as they were (a test or a user may have registered a module themselves)."""

from __future__ import annotations

import sys
import uuid

import cloudpickle
import cloudpickle.cloudpickle as cp

from spark_estimators._base.pickling import dumps_by_value


def _module(tmp_path, monkeypatch):
    name = f"se_helper_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_a_module_found_here_is_registered_only_while_pickling(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch)
    payload = dumps_by_value(module.double)
    assert module.__name__ not in cp._PICKLE_BY_VALUE_MODULES
    # By value: the payload loads where the module cannot be imported.
    monkeypatch.delitem(sys.modules, module.__name__)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    assert cloudpickle.loads(payload)(21) == 42


def test_a_module_the_caller_registered_stays_registered(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch)
    cloudpickle.register_pickle_by_value(module)
    try:
        dumps_by_value(module.double)
        assert module.__name__ in cp._PICKLE_BY_VALUE_MODULES
    finally:
        cloudpickle.unregister_pickle_by_value(module)
