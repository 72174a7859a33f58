"""LightningEstimator with manual optimization and two optimizers: a GAN (issue 44 item 5).

Before, the generator's step left the discriminator's parameters without gradients and DDP failed
("Expected to have finished reduction in the prior iteration ..." / unused parameters), and the
way out its message named (a ``strategy`` with ``find_unused_parameters``) was refused. Now a
module with ``automatic_optimization = False`` gets DDP with ``find_unused_parameters=True``,
and ``trainer_args={"strategy": "ddp_find_unused_parameters_true"}`` (or ``..._false``) is taken.
"""

from __future__ import annotations

import numpy as np
import pytest

pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")

from pyspark.ml.linalg import Vectors  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.lightning import LightningEstimator  # noqa: E402
from spark_estimators.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess, pytest.mark.timeout(300)]


class TinyGAN(pl.LightningModule):
    """A generator of 4-vectors from 2-d noise and a discriminator; two optimizers, by hand."""

    def __init__(self, toggle: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = torch.nn.Linear(2, 4)
        self.discriminator = torch.nn.Linear(4, 1)

    def forward(self, x):
        return torch.sigmoid(self.discriminator(x))

    def training_step(self, batch, batch_idx):
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        opt_g, opt_d = self.optimizers()
        real = batch["features"]
        z = torch.randn(len(real), 2)
        if self.toggle:
            self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), torch.ones(len(real), 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
        d_loss = bce(self.discriminator(real), torch.ones(len(real), 1)) + bce(
            self.discriminator(fake.detach()), torch.zeros(len(real), 1)
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        if self.toggle:
            self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.05),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05),
        )


@pytest.fixture(scope="module")
def real_vectors(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(loc=2.0, size=(128, 4))
    return spark.createDataFrame([(Vectors.dense(r.tolist()), 1.0) for r in x], ["features", "y"])


def _estimator(tmp_path, module, **kw):
    opts = dict(
        num_proc=2,
        store=LocalStore(str(tmp_path)),
        model=module,
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
        verbose=0,
    )
    opts.update(kw)
    return LightningEstimator(**opts)


@pytest.mark.parametrize("toggle", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_gan_with_two_optimizers_trains_on_two_ranks(spark, real_vectors, tmp_path, toggle):
    module = TinyGAN(toggle=toggle)
    before = module.generator.weight.detach().clone()
    model = _estimator(tmp_path, module).fit(real_vectors)
    history = model.getHistory()
    assert len(history["g_loss"]) == 2 and len(history["d_loss"]) == 2
    assert all(np.isfinite(history["g_loss"])) and all(np.isfinite(history["d_loss"]))
    trained = model.getModel()
    assert not torch.equal(trained.generator.weight.detach(), before)  # the generator learned
    scores = [r[0] for r in model.setOutputCols(["score"]).transform(real_vectors).select(
        "score").collect()]  # fmt: skip
    assert len(scores) == 128 and all(0.0 <= float(np.ravel(s)[0]) <= 1.0 for s in scores)


def test_the_ddp_strategy_names_are_accepted_and_others_refused(spark, real_vectors, tmp_path):
    from spark_estimators.lightning.trainer import find_unused_parameters

    assert find_unused_parameters({"strategy": "ddp_find_unused_parameters_true"}, object())
    assert not find_unused_parameters({"strategy": "ddp"}, TinyGAN())  # the user's word wins
    assert find_unused_parameters({}, TinyGAN())  # manual optimization: on by default
    est = _estimator(tmp_path, TinyGAN(), trainer_args={"strategy": "deepspeed"})
    with pytest.raises(ConfigurationError, match="strategy.*'deepspeed'.*ddp_find_unused"):
        est.fit(real_vectors)  # in the driver, before any job
