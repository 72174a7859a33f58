"""Keras classes defined in ``__main__`` (a notebook's cells) train on the ranks (issue 41).

A registered layer and a subclassed ``keras.Model`` defined in a script run as ``__main__``
(``scripts/keras_main_classes.py``, its own Spark session in a subprocess): before issue 41 the
ranks failed with Keras's "Could not locate class" (Keras writes no module for ``__main__``
classes, so the driver never shipped them), with or without ``custom_objects``. Each run fits,
transforms, saves and loads the Spark model and a ``.keras`` file, all predicting alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("keras")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent / "scripts" / "keras_main_classes.py"


@pytest.mark.parametrize(
    "mode",
    [
        "none",  # no custom_objects at all
        pytest.param("plain", marks=pytest.mark.slow),  # {"Scale": Scale, "Regressor": ...}
        pytest.param("package", marks=pytest.mark.slow),  # {"nb>Scale": Scale, ...}
    ],
)
def test_main_classes_fit_transform_save_and_load(mode, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=560,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["classes"] == ["Regressor", "Scale"]
    losses = result["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    np.testing.assert_allclose(result["transform"], result["want_rows"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["reloaded"], result["want"], rtol=1e-6)
    np.testing.assert_allclose(result["keras_file"], result["want"], rtol=1e-6)
