"""Conformance suite: horovod's own tests, ported by changing imports (see README.md).

The suite runs in a pytest process of its own (``make test-conformance``, or any pytest
command line naming a path inside ``tests/conformance``): horovod's tests start, reuse and stop
Spark sessions through their ``spark_session`` helper (utils/spark_common.py), including
sessions with task retries (``local[2,3]``) that cannot share a process with the repository's
session-scoped ``spark`` fixture. A pytest run over the whole repository (``make test``) skips
this directory; CI runs it through ``make test-conformance``.

Every test collected here gets the ``conformance`` marker. The files under ``parallel/`` are
horovod's ``horovodrun -np 2`` tests: pytest collects them only inside a rank of our launcher
(test_parallel.py starts that), and ``examples/`` holds horovod's example scripts, which
test_examples.py runs as scripts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent.resolve()

# Inside a rank of spark_estimators.launch the launcher sets SPARK_ESTIMATORS_RANK.
_IN_RANK = "SPARK_ESTIMATORS_RANK" in os.environ


def _selected(config: pytest.Config) -> bool:
    """Whether the command line names this directory or a path inside it."""
    base = Path(config.invocation_params.dir)
    for arg in config.invocation_params.args:
        arg = str(arg)
        if arg.startswith("-"):
            continue
        path = (base / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not _selected(config):
        return True
    parts = Path(collection_path).resolve().relative_to(HERE).parts
    if parts and parts[0] == "parallel" and not _IN_RANK:
        return True
    if parts and parts[0] == "examples":
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.conformance)
    _mark_integration(items)


def _mark_integration(items: list[pytest.Item]) -> None:
    """Spark tests: the repository's leak check (tests/conftest.py) looks at these markers."""
    for item in items:
        if (HERE / "integration") in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.spark)
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_spark_session():
    """Stop the session utils/spark_common.py shares between horovod's tests."""
    yield
    module = sys.modules.get("spark_common")
    if module is not None:
        module.stop_shared_session()
