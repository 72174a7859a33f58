"""Every public module imports in a fresh process, and the core never imports a framework."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import spark_estimators

FRAMEWORKS = ("torch", "tensorflow", "keras", "pytorch_lightning", "lightning")
# Modules that must not pull in a deep-learning framework when imported.
FRAMEWORK_FREE = (
    "spark_estimators",
    "spark_estimators.errors",
    "spark_estimators.envvars",
    "spark_estimators.runner",
    "spark_estimators.driver",
    "spark_estimators.task",
    "spark_estimators.task.child",
    "spark_estimators.core.session",
)


def public_modules() -> list[str]:
    names = ["spark_estimators"]
    for info in pkgutil.walk_packages(spark_estimators.__path__, "spark_estimators."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def _import_in_fresh_process(name: str) -> dict:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({name!r})\n"
        f"print(json.dumps(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return {"rc": proc.returncode, "stderr": proc.stderr, "frameworks": proc.stdout}


@pytest.mark.timeout(600)
def test_every_public_module_imports_in_a_fresh_process():
    modules = public_modules()
    assert "spark_estimators.runner" in modules
    failures = {}
    for name in modules:
        res = _import_in_fresh_process(name)
        if res["rc"] != 0:
            failures[name] = res["stderr"].strip().splitlines()[-1:]
    assert failures == {}


@pytest.mark.parametrize("name", FRAMEWORK_FREE)
def test_core_modules_import_no_framework(name):
    res = _import_in_fresh_process(name)
    assert res["rc"] == 0, res["stderr"]
    assert json.loads(res["frameworks"]) == []
