"""Every Python block of docs/*.md and README.md runs as written (issue 41).

The rule and the markers are in :mod:`doc_blocks`: each page's blocks in page order in a fresh
namespace (``spark`` a local[2] session as in a notebook); all pages in one process, so the JVM
starts once (SLOW_PAGES in a second one, in the slow suite); a block that cannot run here is
marked in the Markdown with its reason and counted. The counts are printed at the end of the
pytest run (tests/docs/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from doc_blocks import ROOT, blocks, pages, stray_markers

#: Run in the slow suite: the TensorFlow page (slow to import and fit), and tracking.md, whose
#: blocks test_tracking_examples.py runs in the fast suite already.
SLOW_PAGES = {"docs/keras.md", "docs/tracking.md"}
#: All pages of a group run in one process: JVM start, then each page's fits.
RUN_TIMEOUT_S = 900


def _page_id(page) -> str:
    return page.relative_to(ROOT).as_posix()


def _runnable_pages():
    found = []
    for page in pages():
        if not any(b.status == "run" for b in blocks(page)):
            continue
        marks = [pytest.mark.slow] if _page_id(page) in SLOW_PAGES else []
        found.append(pytest.param(page, id=_page_id(page), marks=marks))
    return found


def test_every_python_block_runs_or_says_why_not():
    """A marker needs its reason and must stand right before a Python fence."""
    stray = {_page_id(p): lines for p in pages() if (lines := stray_markers(p))}
    assert not stray, f"docs-test markers not before a ```python fence, or malformed: {stray}"
    all_blocks = [b for p in pages() for b in blocks(p)]
    assert all(b.reason.strip() for b in all_blocks if b.status != "run")
    # The pages the issue names are run, not marked away.
    running = {b.page for b in all_blocks if b.status == "run"}
    expected = {"docs/elastic.md", "docs/keras.md", "docs/store_and_data.md", "README.md"}
    assert expected <= running


def _run_pages(page_ids: list[str], cwd) -> str:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": path}
    env.pop("SPARK_ESTIMATORS_TEST_SESSION", None)  # its rank processes are its own business
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs" / "doc_blocks.py")]
        + [str(ROOT / page_id) for page_id in page_ids],
        cwd=cwd,  # files the examples write (mlflow.db, ...) land here
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return done.stdout + f"\n--- stderr (exit code {done.returncode})\n" + done.stderr[-6000:]


@pytest.fixture(scope="module")
def page_outputs(request, tmp_path_factory):
    """Runs the selected pages of a group in one process (one JVM start), once per group.

    Returns ``group -> output``; a page's test reads its own ``DOCS-BLOCK`` lines from it.
    """
    selected = [
        item.callspec.params["page"]
        for item in request.session.items
        if hasattr(item, "callspec") and "page" in item.callspec.params
    ]
    outputs: dict[bool, str] = {}

    def output_for(page_id: str) -> str:
        slow = page_id in SLOW_PAGES
        if slow not in outputs:
            group = [_page_id(p) for p in selected if (_page_id(p) in SLOW_PAGES) == slow]
            outputs[slow] = _run_pages(group, tmp_path_factory.mktemp("docs"))
        return outputs[slow]

    return output_for


@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("page", _runnable_pages())
def test_page_blocks_run_as_written(page, page_outputs):
    output = page_outputs(_page_id(page))
    ran = [ln.split()[1:] for ln in output.splitlines() if ln.startswith("DOCS-BLOCK ")]
    want = [f"{b.page}:{b.line}" for b in blocks(page) if b.status == "run"]
    mine = [(r[0], r[-1]) for r in ran if r[0].rsplit(":", 1)[0] == _page_id(page)]
    if any(how == "failed" for _, how in mine) or [w for w, _ in mine] != want:
        start = output.find(f"DOCS-BLOCK {_page_id(page)}:")
        pytest.fail(f"ran {mine}, expected {want} all ok:\n{output[max(start, 0) :][:8000]}")
    print("\n".join(f"{where} ok in {how}" for where, how in mine))  # with -s / -rP: timings
    if _page_id(page) == "README.md":  # what the page's comments promise
        assert "[(0, 42), (1, 42)]" in output
