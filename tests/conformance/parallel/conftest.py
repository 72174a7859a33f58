"""Rank-side plumbing for horovod's ``horovodrun -np 2`` tests under our launcher.

Each rank writes its per-test outcomes to ``$CONFORMANCE_REPORT_DIR/rank<N>.json`` for the
wrapper test (test_parallel.py) to check. Nothing else is needed: like ``horovodrun --gloo``,
the launcher gives each rank ``HOROVOD_RANK`` / ``HOROVOD_SIZE`` / ``HOROVOD_LOCAL_RANK`` / ...,
which horovod's test_torch.py reads to know it runs under Gloo.
"""

from __future__ import annotations

import json
import os
import sys

# horovod's test/utils (common.py), which test_tensorflow_process_sets.py imports without adding
# it to sys.path itself (horovod's CI ran from a directory that had it).
sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, "utils"))

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    # One outcome per test: a failed setup/teardown wins over the call's outcome.
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        if report.when != "call" and report.failed:
            outcome = "error"
        if _outcomes.get(report.nodeid) not in ("failed", "error"):
            _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("CONFORMANCE_REPORT_DIR")
    if out:
        path = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as f:
            json.dump({"exitstatus": int(exitstatus), "outcomes": _outcomes}, f, indent=1)
