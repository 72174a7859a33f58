"""Rank start-up: eager training in a rank never imports torch._dynamo; torch.compile works."""

from __future__ import annotations

import pytest

import spark_estimators

pytest.importorskip("torch")

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _train_then_maybe_compile(compile_after: bool, spark_task: bool = True):
    import sys
    import time

    import torch

    import spark_estimators.collective.torch as hvd
    from spark_estimators.task import context

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x = torch.randn(32, 4) + hvd.rank()
    y = x.sum(1, keepdim=True)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    losses = [step() for _ in range(3)]
    out = {
        "real_dynamo": "torch._dynamo.eval_frame" in sys.modules,
        "losses": losses,
        "since_task_start": time.time() - context.task_started() if spark_task else 1.0,
    }
    if compile_after:
        out["compiled"] = torch.compile(lambda a: torch.cos(a) + 1, backend="eager")(
            torch.zeros(2)
        ).tolist()
        out["real_after_compile"] = "torch._dynamo.eval_frame" in sys.modules
    return out


def test_eager_ranks_do_not_import_torch_dynamo(spark):
    out = spark_estimators.run(_train_then_maybe_compile, args=(True,), num_proc=2, spark=spark)
    for rank in out:
        assert rank["real_dynamo"] is False
        assert rank["losses"][-1] < rank["losses"][0]
        assert 0 < rank["since_task_start"] < 120
        assert rank["compiled"] == [2.0, 2.0]
        assert rank["real_after_compile"] is True


def test_lazy_dynamo_can_be_turned_off(spark):
    out = spark_estimators.run(
        _train_then_maybe_compile,
        args=(False,),
        num_proc=2,
        spark=spark,
        env={"SPARK_ESTIMATORS_LAZY_DYNAMO": "0"},
    )
    assert [rank["real_dynamo"] for rank in out] == [True, True]


def test_local_ranks_do_not_import_torch_dynamo_either():
    """run_local's ranks (LocalBackend, the launcher): the same stand-in as Spark's ranks.

    Without it the reader's background preload imported the real torch._dynamo (~2 s of CPU)
    while the first epoch trained (issue 45).
    """
    from spark_estimators.launch import run_local

    out = run_local(_train_then_maybe_compile, num_proc=2, args=(True, False))
    for rank in out:
        assert rank["real_dynamo"] is False
        assert rank["losses"][-1] < rank["losses"][0]
        assert rank["compiled"] == [2.0, 2.0]
        assert rank["real_after_compile"] is True
