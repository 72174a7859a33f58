"""``checks.import_framework``: the estimators' one guard for a missing framework."""

from __future__ import annotations

import json

import pytest

from spark_estimators.core import checks


def test_an_installed_framework_is_returned():
    assert checks.import_framework("json", "X needs json", "x[json]") is json


def test_a_missing_framework_names_the_install_command():
    with pytest.raises(ImportError, match=r"^FooEstimator needs Foo: pip install 'pkg\[foo\]'$"):
        checks.import_framework("no_such_framework_h24", "FooEstimator needs Foo", "pkg[foo]")
