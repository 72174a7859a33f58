"""TorchEstimator fit + transform on six ranks over three hosts.

The store is a directory under the harness's work directory: the namespaces share the machine's
filesystem, as a shared mount would on real hosts.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

TRUE_WEIGHTS = [1.0, -2.0, 0.5]


def _check(answer: dict) -> None:
    assert "error" not in answer, answer.get("tb")
    history = answer["history"]
    assert len(history) == 4
    assert history[-1] < history[0] / 4  # the loss went down across the six ranks
    assert answer["transform_rows"] == 600
    assert answer["transform_mse"] < 0.05
    np.testing.assert_allclose(answer["weights"], TRUE_WEIGHTS, atol=0.15)


def test_torch_estimator_fit_and_transform_on_parquet(agent) -> None:
    _check(agent.call("torch_fit", timeout=500, data="parquet"))


def test_torch_estimator_fit_and_transform_streamed(agent) -> None:
    _check(agent.call("torch_fit", timeout=500, data="stream"))
