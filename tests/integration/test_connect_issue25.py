"""issue 25 on a Spark Connect client: stage overwrite (item 13) and the prepare_data cache (12).

A real local Spark Connect server runs in a child process (a classic session may already live in
this one), driven by ``scripts/connect_issue25.py``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("grpc", reason="Spark Connect needs the [connect] extra")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(600)]

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "connect_issue25.py"


@pytest.fixture(scope="module")
def result() -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=540
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["session"] == "pyspark.sql.connect.session"
    return out


def test_write_overwrite_save_replaces_the_stage(result):
    # was: AttributeError ... '_jsparkSession' inside pyspark's MLWriter._handleOverwrite
    assert result["overwrite"] == {"loaded_epochs": [3, 5]}


def test_equal_pipelines_reuse_the_prepared_dataset(result):
    cache = result["cache"]
    assert "error" not in cache, cache
    first, second = cache["semantic_hashes"]
    assert first != second  # the premise: the server's hash differs for equal pipelines
    assert cache["again"] == cache["first"] != cache["other"]
    plain, again = cache["plain"]
    assert plain == again  # a plain file read too
    assert sorted(cache["datasets"]) == sorted({cache["first"], cache["other"], plain})
    assert cache["rows"] == 40
