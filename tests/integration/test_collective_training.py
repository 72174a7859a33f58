"""DistributedOptimizer: 2 ranks x batch B train exactly like 1 process on the 2B batch.

Each rank also trains the single-process reference on the concatenated batch itself (the data
is generated from one seed everywhere), so one 2-process launch checks every configuration.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_estimators.launch import run_local

SIZE = 2
BATCH = 8
STEPS = 5
FEATURES = 8

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

# name -> (DistributedOptimizer keyword arguments, optimizer, tolerance vs the reference)
CONFIGS = {
    "default": ({}, "sgd", 1e-5),
    "backward_passes_2": ({"backward_passes_per_step": 2}, "sgd", 1e-5),
    "no_fusion": ({"fusion_threshold": 0}, "sgd", 1e-5),
    "small_buckets_passes_2": (
        {"fusion_threshold": 1024, "backward_passes_per_step": 2},
        "sgd",
        1e-5,
    ),
    "groups": ({"groups": 2}, "sgd", 1e-5),
    "adam_predivide": ({"gradient_predivide_factor": 2.0}, "adam", 1e-5),
    "fp16": ({"compression": "fp16"}, "sgd", 2e-3),
    "sync_batch_norm": ({}, "sgd", 1e-5),
}


def _make_model(sync_bn: bool):
    import torch
    from torch import nn

    import spark_estimators.collective.torch as hvd

    if sync_bn:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(FEATURES, 16), hvd.SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 1)
        )
        torch.manual_seed(0)
        reference = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)
        )
        return model, reference

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            # Registered first, so its gradients would come last: never gets one.
            self.unused = nn.Linear(2, 2)
            self.fc1 = nn.Linear(FEATURES, 16)
            self.fc2 = nn.Linear(16, 16)
            self.out = nn.Linear(16, 1)
            self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

        def forward(self, x):
            return self.out(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))

    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(0)
    reference = Net()
    return model, reference


def _optimizer(kind, params):
    import torch

    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(configs: dict) -> dict:
    import torch

    import spark_estimators.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    for name, (kwargs, kind, _) in configs.items():
        kwargs = dict(kwargs)
        if kwargs.get("compression") == "fp16":
            kwargs["compression"] = hvd.Compression.fp16
        passes = kwargs.get("backward_passes_per_step", 1)
        model, reference = _make_model(sync_bn=name == "sync_batch_norm")
        opt = hvd.DistributedOptimizer(
            _optimizer(kind, model.parameters()),
            named_parameters=model.named_parameters(),
            **kwargs,
        )
        ref_opt = _optimizer(kind, reference.parameters())
        gen = torch.Generator().manual_seed(42)
        x = torch.randn(STEPS, passes, SIZE * BATCH, FEATURES, generator=gen)
        y = torch.randn(STEPS, passes, SIZE * BATCH, 1, generator=gen)
        mine = slice(r * BATCH, (r + 1) * BATCH)
        in_flight_after_backward = []
        for step in range(STEPS):
            for p in range(passes):
                loss = torch.nn.functional.mse_loss(model(x[step, p, mine]), y[step, p, mine])
                loss.backward()
            in_flight_after_backward.append(len(opt._se_inflight))
            opt.step()
            opt.zero_grad()
            for p in range(passes):
                torch.nn.functional.mse_loss(reference(x[step, p]), y[step, p]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        out[name] = {
            "dist": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            "ref": {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()},
            "buckets": len(opt._se_buckets),
            "in_flight_after_backward": in_flight_after_backward,
        }
    out["errors"] = _misuse_errors()
    hvd.shutdown()
    return out


def _misuse_errors() -> dict:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    errors = {}
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(2, 3)).sum().backward()
    try:
        model(torch.ones(2, 3)).sum().backward()  # a second pass with backward_passes_per_step=1
    except CollectiveError as exc:
        errors["too_many_passes"] = str(exc)
    try:
        opt.zero_grad()
    except CollectiveError as exc:
        errors["zero_grad_in_flight"] = str(exc)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    return errors


@pytest.fixture(scope="module")
def trained():
    return run_local(_train, num_proc=SIZE, args=(CONFIGS,), backend="gloo")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ranks_identical_and_equal_to_single_process(trained, name):
    tolerance = CONFIGS[name][2]
    rank0, rank1 = trained[0][name], trained[1][name]
    assert rank0["dist"].keys() == rank0["ref"].keys()
    moved = False
    for key, value in rank0["dist"].items():
        np.testing.assert_array_equal(value, rank1["dist"][key], err_msg=f"{name}: {key}")
        np.testing.assert_allclose(
            value, rank0["ref"][key], rtol=0, atol=tolerance, err_msg=f"{name}: {key}"
        )
        np.testing.assert_array_equal(rank0["ref"][key], rank1["ref"][key])
        moved |= key.startswith(("fc1", "0.")) and not np.allclose(value, 0)
    assert moved


def test_training_really_moved_the_weights(trained):
    import torch

    model, _ = _make_model(sync_bn=False)
    initial = model.state_dict()
    final = trained[0]["default"]["dist"]
    assert np.abs(final["fc1.weight"] - initial["fc1.weight"].numpy()).max() > 1e-2
    np.testing.assert_array_equal(final["unused.weight"], initial["unused.weight"].numpy())
    np.testing.assert_array_equal(final["frozen"], torch.ones(3).numpy())


def test_sync_batch_norm_running_stats_match(trained):
    dist, ref = trained[0]["sync_batch_norm"]["dist"], trained[0]["sync_batch_norm"]["ref"]
    np.testing.assert_allclose(dist["1.running_mean"], ref["1.running_mean"], atol=1e-6)
    np.testing.assert_allclose(dist["1.running_var"], ref["1.running_var"], atol=1e-5)
    assert int(dist["1.num_batches_tracked"]) == STEPS


def test_buckets_follow_the_fusion_threshold_and_launch_during_backward(trained):
    result = trained[0]
    assert result["default"]["buckets"] == 1
    assert result["no_fusion"]["buckets"] == 8  # 4 layers x (weight, bias)
    assert result["groups"]["buckets"] == 2
    assert 1 < result["small_buckets_passes_2"]["buckets"] < 8
    # Hooks launched the 6 used parameters' allreduces while backward ran; step() launched the
    # 2 buckets of the never-used layer (zeros) and waited.
    assert result["no_fusion"]["in_flight_after_backward"] == [6] * STEPS


def test_misuse_is_reported(trained):
    for r in range(SIZE):
        errors = trained[r]["errors"]
        assert "backward_passes_per_step=1" in errors["too_many_passes"]
        assert "zero_grad" in errors["zero_grad_in_flight"]
