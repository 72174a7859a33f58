"""horovod's examples/tensorflow2/tensorflow2_mnist.py through ``spark_estimators.run(fn)``.

The example is a custom TF2 loop (``hvd.DistributedGradientTape`` in a ``tf.function`` step,
``hvd.broadcast_variables`` after the first step, ``hvd.size()``-scaled learning rate, rank-0
checkpoint). Its ``__main__`` runs ``main`` through ``spark_estimators.run(main, num_proc=N)``
when given ``N hosts comm`` (horovod's ``horovod.run`` path), on the embedded ``local[2]``
session. The harness gives it a synthetic MNIST-shaped ``.npz`` (horovod's downloads MNIST) and
a step count; the example's accuracy on 2 ranks must match one process within a tolerance.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SCRIPT = HERE / "examples" / "tensorflow2_mnist.py"
STEPS = 200  # in total: 200 steps on one process, 100 per rank on two


def _write_synthetic_mnist(path: Path, rows: int = 3000, seed: int = 0) -> None:
    """28x28 uint8 images: class c lights rows 2c+4..2c+5, plus noise pixels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(rows) % 10
    images = np.zeros((rows, 28, 28), np.uint8)
    for i, label in enumerate(labels):
        images[i, 2 * label + 4 : 2 * label + 6, 4:24] = 255
        noise = rng.integers(0, 784, size=20)
        images[i].flat[noise] = rng.integers(1, 256, size=20)
    np.savez(path, x_train=images, y_train=labels.astype(np.uint8))


def _run(tmp_path: Path, num_proc: int) -> float:
    work = tmp_path / f"np{num_proc}"
    work.mkdir()
    data = tmp_path / "mnist.npz"
    if not data.exists():
        _write_synthetic_mnist(data)
    env = dict(os.environ)
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CONFORMANCE_MNIST_NPZ=str(data),
               CONFORMANCE_STEPS=str(STEPS))  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(num_proc), f"localhost:{num_proc}", "gloo"],
        cwd=work, env=env, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tensorflow2_mnist.py exited {proc.returncode}:\n{out[-8000:]}"
    assert "Running training through horovod.run" in proc.stdout
    losses = [float(x) for x in re.findall(r"Step #\d+\tLoss: ([0-9.]+)", proc.stdout)]
    assert len(losses) == -(-(STEPS // num_proc) // 10), out[-4000:]  # every 10th step
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    # rank 0 saved its checkpoint (horovod's rank-0 checkpointing)
    assert list(work.glob("checkpoints*.index")), sorted(p.name for p in work.iterdir())
    match = re.search(r"Accuracy: ([0-9.]+)", proc.stdout)
    assert match, f"no accuracy printed:\n{out[-4000:]}"
    return float(match.group(1))


@pytest.mark.slow  # about 6 minutes on a busy 2-core machine
@pytest.mark.spark
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_tensorflow2_mnist_two_ranks_match_one_process(tmp_path):
    one = _run(tmp_path, 1)
    two = _run(tmp_path, 2)
    print(f"accuracy: 1 process {one:.4f}, 2 ranks {two:.4f}")
    # Chance is 0.1; the bars are easy to tell apart. 2 ranks: half the steps at twice the
    # batch and learning rate.
    assert one > 0.9 and two > 0.9, (one, two)
    assert abs(one - two) <= 0.05, (one, two)
