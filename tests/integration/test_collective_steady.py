"""DistributedOptimizer's steady state (collective/torch/steady.py) with real rank processes.

From the second step the last bucket skips the engine's negotiation on same-host ranks. These
tests check that it is taken (its counter), that it gives bit for bit the engine's gradients
(the same training with ``SPARK_ESTIMATORS_STEADY_ALLREDUCE=0``), and that ranks out of step
(another optimizer, ``join()``, a dead peer) get the engine's behaviour or a clear error,
never a hang or mixed tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

from spark_estimators.launch import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

STEPS = 6
# name -> DistributedOptimizer keyword arguments (op and compression by name)
CONFIGS: dict[str, dict[str, Any]] = {
    "average": {},
    "sum_two_buckets": {"op": "Sum", "fusion_threshold": 2048},
    "passes_2": {"backward_passes_per_step": 2},  # backward adds twice into lent gradients
    "fp16_predivide_passes_2": {
        "compression": "fp16",
        "gradient_predivide_factor": 2.0,
        "backward_passes_per_step": 2,
    },
}


def _model(seed: int, width: int = 32) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 16),
        torch.nn.ReLU(), torch.nn.Linear(16, 1),
    )  # fmt: skip


def _optimizer(model: Any, **kwargs: Any) -> Any:
    import torch

    import spark_estimators.collective.torch as hvd

    if "op" in kwargs:
        kwargs["op"] = getattr(hvd, kwargs["op"])
    if "compression" in kwargs:
        kwargs["compression"] = getattr(hvd.Compression, kwargs["compression"])
    return hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        named_parameters=model.named_parameters(),
        **kwargs,
    )


def _steps(model: Any, opt: Any, steps: int, passes: int = 1, seed: int = 0) -> None:
    import torch

    import spark_estimators.collective.torch as hvd

    g = torch.Generator().manual_seed(100 * hvd.rank() + seed)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(passes):
            x = torch.randn(16, 8, generator=g)
            model(x).pow(2).mean().backward()
        opt.step()


def _train_configs() -> dict[str, Any]:
    import spark_estimators.collective.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    for name, kwargs in CONFIGS.items():
        model = _model(0)
        opt = _optimizer(model, **kwargs)
        _steps(model, opt, STEPS, kwargs.get("backward_passes_per_step", 1))
        steady = opt._se_steady
        opt.zero_grad()  # the default: the steady bucket's gradients become its wire's views
        wire = steady._wire
        lent = wire is not None and wire.holds_gradients()
        zeroed = all(p.grad is not None and not p.grad.any() for p in steady.params)
        hooks_lent = len(opt._se_hooks)  # the lent bucket's parameters have none
        opt.zero_grad(set_to_none=True)  # torch's behaviour when asked for
        hooks_back = len(opt._se_hooks)
        out[name] = {
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            "taken": steady.taken,
            "voided": steady.voided,
            "buckets": len(opt._se_buckets),
            "lent": lent and zeroed,
            "none_when_asked": all(p.grad is None for p in model.parameters()),
            "hooks": (hooks_lent, hooks_back, len(list(model.parameters())), len(steady.params)),
            "too_many_passes": _second_pass_error(model) if name == "average" else None,
        }
    hvd.shutdown()
    return out


def _second_pass_error(model: Any) -> str | None:
    """Two backward passes where the optimizer allows one: its hook's error (None: none)."""
    import torch

    from spark_estimators.errors import CollectiveError

    model(torch.ones(4, 8)).sum().backward()
    try:
        model(torch.ones(4, 8)).sum().backward()
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("num_proc", [2, 3])
def test_steady_state_is_taken_and_equals_the_engine_bit_for_bit(num_proc: int) -> None:
    """Three ranks: sums in rank order that do not start with this rank's own gradients."""
    steady = run_local(_train_configs, num_proc=num_proc)
    engine = run_local(
        _train_configs, num_proc=num_proc, env={"SPARK_ESTIMATORS_STEADY_ALLREDUCE": "0"}
    )
    for name in CONFIGS:
        # gradients lent to backward where the wire carries their own bits (not with fp16)
        assert [r[name]["lent"] for r in steady] == [name != "fp16_predivide_passes_2"] * num_proc
        assert all(r[name]["none_when_asked"] for r in steady + engine), name
        assert not any(r[name]["lent"] for r in engine), name
        # no hook on the lent bucket's parameters (synchronize() launches it), all back after
        # zero_grad(set_to_none=True)
        for r in steady + engine:
            lent_hooks, hooks_back, params, in_bucket = r[name]["hooks"]
            lent = r in steady and name != "fp16_predivide_passes_2"
            assert lent_hooks == (params - in_bucket if lent else params), (name, r[name]["hooks"])
            assert hooks_back == params, name
        if name == "average":  # the hooks that came back check the passes again
            assert all("computed more than" in r[name]["too_many_passes"] for r in steady)
        for rank in range(num_proc):
            assert steady[rank][name]["taken"] == STEPS - 1, name  # every step after the first
            assert steady[rank][name]["voided"] == 0, name
            assert engine[rank][name]["taken"] == 0, name
            # exact float equality: the same bits as the negotiated path, on every rank
            assert steady[rank][name]["weights"] == engine[rank][name]["weights"], name
            assert steady[rank][name]["weights"] == steady[0][name]["weights"], name
    assert steady[0]["sum_two_buckets"]["buckets"] >= 2  # the first bucket took the engine


def _out_of_step() -> dict[str, Any]:
    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    rank, out = hvd.rank(), {}
    a, b = _model(0), _model(1, width=24)  # another bucket: other shapes
    opt_a, opt_b = _optimizer(a), _optimizer(b)
    _steps(a, opt_a, 3)
    _steps(b, opt_b, 1)
    out["armed_taken"] = opt_a._se_steady.taken
    # Rank 1 steps the other optimizer: the steady round is void, the engine's path says why.
    model, opt = (a, opt_a) if rank == 0 else (b, opt_b)
    try:
        _steps(model, opt, 1, seed=7)
        out["error"] = "no error"
    except CollectiveError as exc:
        out["error"] = str(exc)
    out["voided"] = opt._se_steady.voided
    out["after"] = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="after").item()
    # join(): rank 1 stops; rank 0's next step is void, then averaged with zeros (Horovod).
    # (Another width: a bucket of a's shapes has a's tag, whose void above set its back-off.)
    c = _model(2, width=40)
    opt_c = _optimizer(c)
    _steps(c, opt_c, 2)
    if rank == 1:
        out["join"] = hvd.join()
    else:
        opt_c.zero_grad()
        c(torch.randn(16, 8)).pow(2).mean().backward()
        local = [p.grad.clone() for p in c.parameters()]
        opt_c.synchronize()
        out["halved"] = all(torch.equal(p.grad, g / 2) for p, g in zip(c.parameters(), local))
        with opt_c.skip_synchronize():
            opt_c.step()
        out["join_voided"] = opt_c._se_steady.voided
        out["join"] = hvd.join()
    hvd.shutdown()
    return out


def test_ranks_out_of_step_fall_back_to_the_engine_errors_and_join() -> None:
    outs = run_local(_out_of_step, num_proc=2)
    for rank, out in enumerate(outs):
        assert out["armed_taken"] == 2
        assert "mismatched collective op" in out["error"], out["error"]
        assert "rank 0: allreduce 'DistributedOptimizer.bucket0[4.bias, ...]'" in out["error"]
        assert out["voided"] == 1, rank
        assert out["after"] == 3.0  # the group still works after the mismatch
        assert out["join"] == 0  # rank 0 joined last
    assert outs[0]["halved"] is True
    assert outs[0]["join_voided"] == 1


def _steps_after_join(early_steps: int, later_steps: int) -> dict[str, Any]:
    import spark_estimators.collective.torch as hvd

    hvd.init()
    model = _model(0)
    opt = _optimizer(model)
    _steps(model, opt, 3)
    # Rank 1 runs out of data first: rank 0 steps alone (its first try is void, the joined rank
    # contributes zeros), so the ranks' optimizer step counts differ from here on.
    if hvd.rank() == 0:
        _steps(model, opt, early_steps, seed=1)
    last = hvd.join()
    taken = opt._se_steady.taken
    _steps(model, opt, later_steps, seed=2)  # the next epoch: both ranks step again
    out = {
        "last": last,
        "voided": opt._se_steady.voided,
        "taken_later": opt._se_steady.taken - taken,
    }
    hvd.shutdown()
    return out


def test_ranks_whose_steps_differ_after_join_meet_in_the_steady_state_again() -> None:
    """The back-off after a void round is counted in the mesh's rounds, the same on every rank:
    counted in each rank's own optimizer steps, the ranks' tries never met again after a
    ``join()`` (0 of 200 steps taken)."""
    early, later = 10, 200
    outs = run_local(_steps_after_join, num_proc=2, args=(early, later))
    assert [out["last"] for out in outs] == [0, 0]  # rank 0 joined last
    assert outs[0]["voided"] >= 1  # rank 0's try beside the joined rank
    # Every rank takes the same steps from the steady state, most of them: at most the back-off
    # (64 mesh rounds, each a negotiated step) and a few voids pass before the tries meet.
    assert outs[0]["taken_later"] == outs[1]["taken_later"]
    assert outs[0]["taken_later"] >= later - 70, outs


def _peer_dies() -> dict[str, Any]:
    import os
    import time

    import spark_estimators.collective.torch as hvd
    from spark_estimators.errors import CollectiveError

    hvd.init()
    model = _model(0)
    opt = _optimizer(model)
    _steps(model, opt, 3)
    if hvd.rank() == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        _steps(model, opt, 1)
        return {"error": "no error"}
    except CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start,
                "taken": opt._se_steady.taken}  # fmt: skip


def test_a_dead_peer_fails_the_steady_round_at_once_with_a_clear_error() -> None:
    outs = run_local(
        _peer_dies,
        num_proc=2,
        env={"SPARK_ESTIMATORS_COLLECTIVE_TIMEOUT": "60"},
        fail_fast=False,
        return_failures=True,
    )
    out = outs[0]
    assert isinstance(out, dict), out
    assert "steady state, over the local mesh" in out["error"], out["error"]
    assert "closed its local mesh connection" in out["error"], out["error"]
    assert out["seconds"] < 30  # the socket's end, not the 60 s collective timeout
    assert out["taken"] == 2
