"""An elastic estimator fit (``TorchEstimator(elastic=True)``) losing a host in the middle.

The estimators' elastic mode relaunches the training from the last epoch checkpoint in the store
(docs/elastic.md, "Estimators: elastic=True"), not through ``run_elastic``. Six ranks, two per
host; every rank waits at its 8th training batch (epoch 1) until the test has SIGKILLed one
host's Worker, executor and ranks. The fit must relaunch once on the four remaining slots, train
epochs 1..3 again from the epoch-0 checkpoint and return a usable model with one history entry
per epoch. The killed Worker is started again afterwards (a later test that needs the three
executors takes the ``whole_cluster`` fixture, which waits for them).
"""

from __future__ import annotations

import collections
import os
import time

import netns
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)


def _held(folder: str) -> dict[int, str]:
    held = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.isdigit():
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            if text:
                held[int(name)] = text
    return held


def test_elastic_estimator_fit_continues_on_the_survivors_of_a_killed_host(whole_cluster, agent):
    cluster = whole_cluster
    folder = os.path.join(cluster.workdir, "elastic-fit")
    agent.send("torch_elastic_fit")
    deadline = time.monotonic() + 300
    held: dict[int, str] = {}
    while len(held) < 6:
        assert time.monotonic() < deadline, f"ranks never reached the hold batch: {held}"
        time.sleep(0.5)  # the ranks write their files at the hold batch
        held = _held(folder)
    assert collections.Counter(held.values()) == {h.hostname: 2 for h in cluster.hosts}, held
    victim = cluster.hosts[2]  # not the Master's host
    victim_ranks = sorted(r for r, name in held.items() if name == victim.hostname)
    try:
        assert netns.kill_namespace_processes(victim.netns), "nothing ran on the victim host"
        open(os.path.join(folder, "killed"), "w").close()  # noqa: SIM115
        answer = agent.receive(timeout=450)
        assert "error" not in answer, answer.get("tb")
        assert not cluster.processes_in(victim)
    finally:
        cluster.restart_worker(victim)
    print(f"elastic fit took {answer['seconds']:.1f}s; relaunches: {answer['relaunches']}")
    # One relaunch, on the 4 slots left, naming a rank of the killed host.
    relaunches = answer["relaunches"]
    assert len(relaunches) == 1, relaunches
    expected = "relaunching from the last checkpoint with 4 ranks (reset 1 of at most 2)"
    assert expected in relaunches[0], relaunches
    assert any(f"rank {r}:" in relaunches[0] for r in victim_ranks), (victim_ranks, relaunches)
    # Consistent history: each epoch once, in order; the last checkpoint is epoch 3 on 4 ranks.
    assert answer["epochs"] == [0, 1, 2, 3]
    history = answer["history"]
    assert history[-1] < history[0] / 4 and history[-1] < 0.05, history
    assert answer["checkpoint_epoch"] == 3
    assert answer["checkpoint_num_proc"] == 4
    # The model is usable: it learned the weights and transforms every row.
    assert answer["transform_rows"] == 600
    assert answer["transform_mse"] < 0.05
    np.testing.assert_allclose(answer["weights"], [1.0, -2.0, 0.5], atol=0.15)
