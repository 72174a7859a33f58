"""Adding a Param touches three places: its declaration, its default and its use.

The horovod-style keyword (``grad_clip_norm``), the generated ``getX``/``setX``, the
``explainParams`` text, ``copy()`` and the keyword-only constructor follow from the declaration
(issue 28: it was 6-8 places, among them an alias table of snake_case names).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from pyspark.ml.param import TypeConverters

from spark_estimators.core.params import DeclaredParams, make_param, to_camel, to_snake
from spark_estimators.errors import ConfigurationError

torch = pytest.importorskip("torch")

from spark_estimators.torch import TorchEstimator  # noqa: E402


class GradClipParams(DeclaredParams):
    # place 1: the declaration
    gradClipNorm = make_param(
        "gradClipNorm", "clip the gradients' norm to this value", TypeConverters.toFloat
    )
    # place 2: the default
    _defaults: ClassVar[dict[str, Any]] = {"gradClipNorm": 1.0}


class ClippedTorchEstimator(TorchEstimator, GradClipParams):
    def _validate_framework(self) -> None:
        super()._validate_framework()
        # place 3: the use
        if self.getGradClipNorm() <= 0:
            raise ConfigurationError(
                f"grad_clip_norm must be > 0, got {self.getGradClipNorm()!r}; give a positive "
                "norm, e.g. grad_clip_norm=1.0"
            )


def _estimator(**kwargs: Any) -> ClippedTorchEstimator:
    model = torch.nn.Linear(2, 1)
    return ClippedTorchEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        **kwargs,
    )


def test_snake_and_camel_names_follow_one_rule():
    assert to_camel("grad_clip_norm") == "gradClipNorm"
    assert to_snake("gradClipNorm") == "grad_clip_norm"
    assert to_camel("log_every_n_steps") == "logEveryNSteps"
    assert to_snake("logEveryNSteps") == "log_every_n_steps"
    assert to_camel("epochs") == to_snake("epochs") == "epochs"


def test_a_new_param_works_from_its_declaration_and_default():
    est = _estimator()
    assert est.getGradClipNorm() == 1.0
    assert _estimator(grad_clip_norm=0.5).getGradClipNorm() == 0.5  # horovod-style keyword
    assert _estimator(gradClipNorm=2).getGradClipNorm() == 2.0  # Spark ML name, converted
    assert est.setGradClipNorm(3.0) is est and est.getGradClipNorm() == 3.0
    assert est.copy({est.gradClipNorm: 4.0}).getGradClipNorm() == 4.0
    assert "gradClipNorm: clip the gradients' norm to this value (default: 1.0" in (
        est.explainParams()
    )
    with pytest.raises(ConfigurationError, match="Did you mean.*grad_clip_norm"):
        _estimator(grad_clip_nrom=0.5)


def test_a_new_param_is_used_where_it_is_read():
    _estimator(grad_clip_norm=0.5)._validate_framework()  # accepted
    with pytest.raises(ConfigurationError, match=r"grad_clip_norm must be > 0, got -1\.0"):
        _estimator(grad_clip_norm=-1)._validate_framework()
