"""Torch, Lightning and Keras estimators: fit + transform on six ranks over three hosts.

Each on Parquet in a store and with ``data="stream"``. The store is a directory under the
harness's work directory: the namespaces share the machine's filesystem, as a shared mount would
on real hosts. The Lightning and Keras ranks write their host's name at the start of training
(driver_agent.record_host), so the tests see the six ranks spread two per host.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

TRUE_WEIGHTS = [1.0, -2.0, 0.5]


def _check(answer: dict, cluster=None) -> None:
    assert "error" not in answer, answer.get("tb")
    history = answer["history"]
    assert len(history) == 4
    assert history[-1] < history[0] / 4  # the loss went down across the six ranks
    assert history[-1] < 0.05
    assert answer["transform_rows"] == 600
    assert answer["transform_mse"] < 0.05
    np.testing.assert_allclose(answer["weights"], TRUE_WEIGHTS, atol=0.15)
    if cluster is not None:
        hosts = answer["hosts"]
        assert sorted(hosts) == [str(r) for r in range(6)]
        per_host = collections.Counter(hosts.values())
        assert per_host == {h.hostname: 2 for h in cluster.hosts}, hosts


def test_torch_estimator_fit_and_transform_on_parquet(agent) -> None:
    _check(agent.call("torch_fit", timeout=500, data="parquet"))


def test_torch_estimator_fit_and_transform_streamed(agent) -> None:
    _check(agent.call("torch_fit", timeout=500, data="stream"))


@pytest.mark.parametrize("data", ["parquet", "stream"])
def test_lightning_estimator_fit_and_transform(cluster, agent, data: str) -> None:
    _check(agent.call("lightning_fit", timeout=500, data=data), cluster)


@pytest.mark.parametrize("data", ["parquet", "stream"])
def test_keras_estimator_fit_and_transform(cluster, agent, data: str) -> None:
    _check(agent.call("keras_fit", timeout=500, data=data), cluster)
