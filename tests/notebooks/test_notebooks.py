"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel.

Each notebook checks its own results with ``assert`` cells (a metric bound, not just "it ran"),
so a failing assert fails its test here. The kernel is this interpreter's ``python3`` kernel
(ipykernel), started in the repository root; notebooks start their own local Spark session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 900

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess]


def test_the_notebooks_directory_has_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {REPO / 'notebooks'}"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Committed notebooks carry no outputs; they are produced here.
    stale = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count")]
    assert not stale, f"{path.name}: code cells {stale} have stored outputs; clear them"
    assert any("assert " in c.source for c in code), f"{path.name} checks none of its results"
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{path.name} failed:\n{exc}")
