"""docs/tracking.md's Python examples run as written (issue 27 item 3).

The page's ```python blocks are run in order, as one script, in a fresh interpreter whose working
directory is a temporary folder (the example's ``sqlite:///mlflow.db`` lands there); nothing in
the code is changed. Its ``sqlite:`` store needs SQLAlchemy and Alembic: the ``[mlflow]`` extra
must bring them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "tracking.md"

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_the_mlflow_extra_brings_what_the_sqlite_store_needs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=;\[ ]", req)[0].lower() for req in extras["mlflow"]}
    assert {"mlflow-skinny", "sqlalchemy", "alembic"} <= names, names
    pins = (REPO / "constraints.txt").read_text().lower()
    assert "\nsqlalchemy==" in pins and "\nalembic==" in pins


@pytest.mark.timeout(600)
def test_the_tracking_page_examples_run_as_written(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("torch")
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 2 and 'set_tracking_uri("sqlite:///mlflow.db")' in blocks[0]
    script = tmp_path / "tracking_example.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "mlflow.db").is_file()
    value = float(re.search(r"tensor\(\[\[(-?[\d.]+)\]\]", done.stdout).group(1))
    assert abs(value - 1.0) < 0.3, done.stdout
