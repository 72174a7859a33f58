"""issue 25 item 13: ``write().overwrite().save(path)`` is done by our writer (no JVM session).

The Spark Connect case is in test_connect_issue25.py; here the same writer on a classic session,
and the paths it refuses to remove.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from spark_estimators.core.persistence import StageWriter, remove_for_overwrite  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


def estimator(epochs):
    return TorchEstimator(
        model=torch.nn.Linear(2, 1), loss=torch.nn.MSELoss(), feature_cols=["f"], epochs=epochs
    )


def test_overwrite_replaces_a_saved_stage(spark, tmp_path):
    path = str(tmp_path / "est")
    estimator(3).write().overwrite().save(path)  # nothing there yet: just saves
    (tmp_path / "est" / "stale.txt").write_text("from the old save")
    writer = estimator(5).write()
    assert isinstance(writer, StageWriter)
    writer.overwrite().save(path)
    assert TorchEstimator.load(path).getEpochs() == 5
    assert not (tmp_path / "est" / "stale.txt").exists()  # the old directory went as a whole
    with pytest.raises(Exception, match="already exists"):  # no overwrite(): Spark refuses
        estimator(7).write().save(path)
    assert TorchEstimator.load(f"file://{path}").getEpochs() == 5


def test_overwrite_refuses_roots_and_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("/", str(tmp_path), str(tmp_path.parent), ".", "file:///"):
        with pytest.raises(ConfigurationError, match="refusing to overwrite"):
            remove_for_overwrite(path)
    assert os.path.isdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_text("x")
    remove_for_overwrite("sub")  # relative to the working directory, as Spark resolves it
    assert not (tmp_path / "sub").exists()
    remove_for_overwrite(str(tmp_path / "missing"))  # nothing to remove
