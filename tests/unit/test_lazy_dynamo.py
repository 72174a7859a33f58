"""The rank's deferred ``torch._dynamo`` import: eager training never loads it, compile still works.

Each case runs in a fresh interpreter (the stand-in is process-wide, as in a rank process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(240)]

SCRIPT = r"""
import json, sys
from spark_estimators.task import lazy_dynamo
installed = lazy_dynamo.install()
import torch

def real_loaded():
    return "torch._dynamo.eval_frame" in sys.modules

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)

def step():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()

eager = [float(step()) for _ in range(5)]
sched.step()
opt.load_state_dict(opt.state_dict())
torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).step()
after_eager = real_loaded()

compiled_sin = torch.compile(lambda a: torch.sin(a) * 2, backend="eager")(torch.ones(3))
compiled_step = torch.compile(step, backend="eager")
compiled = [float(compiled_step()) for _ in range(3)]
from torch._dynamo.utils import counters
cached = torch.optim.Optimizer.zero_grad.__wrapped__.__dict__["__dynamo_disable"]
print(json.dumps({
    "installed": installed,
    "real_after_eager": after_eager,
    "real_after_compile": real_loaded(),
    "module_is_real": torch._dynamo is sys.modules["torch._dynamo"]
        and not torch._dynamo.__dict__.get("__se_stand_in__", False),
    "cached_is_dynamo_wrapper": cached.__module__.startswith("torch._dynamo"),
    "eager": eager,
    "compiled": compiled,
    "sin": compiled_sin.tolist(),
    "graph_breaks": sorted(k.split("\n")[0] for k in counters["graph_break"]),
    "unique_graphs": counters["stats"]["unique_graphs"],
}))
"""


def _run(lazy: bool) -> dict:
    env = dict(os.environ)
    env["SPARK_ESTIMATORS_LAZY_DYNAMO"] = "1" if lazy else "0"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=200
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_eager_training_never_imports_torch_dynamo_and_compile_matches_the_plain_process():
    lazy, plain = _run(lazy=True), _run(lazy=False)
    assert lazy["installed"] is True
    assert plain["installed"] is False
    assert lazy["real_after_eager"] is False  # Adam, zero_grad, state_dict, SGD: no TorchDynamo
    assert plain["real_after_eager"] is True
    # torch.compile after eager steps: the real module is in place and torch's cached disabled
    # functions are TorchDynamo's own again.
    assert lazy["real_after_compile"] is True
    assert lazy["module_is_real"] is True
    assert lazy["cached_is_dynamo_wrapper"] is True
    assert lazy["sin"] == pytest.approx([2 * 0.8414709848] * 3)
    # Same numbers and the same graphs / graph breaks as a process that imported it up front.
    assert lazy["eager"] == plain["eager"]
    assert lazy["compiled"] == plain["compiled"]
    assert lazy["compiled"][0] < lazy["eager"][-1]
    assert lazy["graph_breaks"] == plain["graph_breaks"]
    assert len(lazy["graph_breaks"]) >= 2
    assert lazy["unique_graphs"] == plain["unique_graphs"]


def test_user_code_using_torch_dynamo_gets_the_real_module():
    code = (
        "from spark_estimators.task import lazy_dynamo; lazy_dynamo.install()\n"
        "import torch, torch._dynamo, sys\n"
        "from torch._dynamo import disable\n"  # a name other than the two served: loads it
        "f = disable(lambda: 3)\n"
        "print(f(), torch._dynamo.__dict__.get('__se_stand_in__', False),"
        " 'torch._dynamo.eval_frame' in sys.modules, hasattr(torch._dynamo, 'reset'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["3", "False", "True", "True"]


def test_init_process_group_after_the_stand_in_does_not_load_torch_dynamo(tmp_path):
    # A rank's preload thread (or an optimizer built first) creates the stand-in before
    # init_process_group, which then clears torch._dynamo.trace_rules' caches.
    code = (
        "from spark_estimators.task import lazy_dynamo; lazy_dynamo.install()\n"
        "import sys, torch, torch._dynamo, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdv', rank=0,"
        " world_size=1)\n"
        "t = torch.ones(2); dist.all_reduce(t); dist.destroy_process_group()\n"
        "print(t.tolist(), 'torch._dynamo.eval_frame' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("]")[-1].split() == ["False"]
