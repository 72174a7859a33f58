"""Each estimator has exactly the Params its framework uses, keyword-only, documented (issue 19).

Decision: the supervised Params (optimizer, loss, loss_constructors, loss_weights, metrics,
gradient_compression, train_minibatch_fn) exist only on the estimators that use them; the
Lightning estimator has none of them (its LightningModule defines them) and refuses the
keywords with the alternative, before any Spark job.
"""

from __future__ import annotations

import inspect
import re

import pytest

torch = pytest.importorskip("torch")

from spark_estimators.core.params import to_snake  # noqa: E402
from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.torch import TorchEstimator, TorchModel  # noqa: E402

SUPERVISED = {
    "optimizer",
    "loss",
    "lossConstructors",
    "lossWeights",
    "metrics",
    "gradientCompression",
    "trainMinibatchFn",
}


def _lightning():
    pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    return LightningEstimator


def _keras():
    pytest.importorskip("keras")
    from spark_estimators.keras import KerasEstimator

    return KerasEstimator


def _classes():
    return [lambda: TorchEstimator, _keras, _lightning]


def _names(est):
    return {p.name for p in est.params}


def test_supervised_params_exist_only_where_the_framework_takes_them():
    assert SUPERVISED <= _names(TorchEstimator())
    keras_names = _names(_keras()())
    assert SUPERVISED - keras_names == {"lossConstructors", "trainMinibatchFn"}
    lightning = _lightning()()
    assert not SUPERVISED & _names(lightning)
    assert lightning.hasParam("loss") is False
    assert not hasattr(lightning, "setLoss")
    assert {"numGpus", "trainerArgs", "logger"} <= _names(lightning)
    assert not {"numGpus", "trainerArgs", "customObjects"} & _names(TorchEstimator())


@pytest.mark.parametrize(
    ("key", "value", "alternative"),
    [
        ("optimizer", "sgd", r"configure_optimizers\(\)"),
        ("loss", torch.nn.MSELoss(), r"training_step\(\) of the module computes the loss"),
        ("loss_constructors", [torch.nn.MSELoss], "training_step"),
        ("loss_weights", [1.0], "training_step"),
        ("lossWeights", [1.0], "training_step"),  # the camelCase name is refused the same way
        ("metrics", [len], r"self\.log"),
        ("gradient_compression", "fp16", "without gradient compression"),
        ("train_minibatch_fn", len, "manual optimization"),
    ],
)
def test_lightning_refuses_supervised_keywords_naming_the_alternative(key, value, alternative):
    cls = _lightning()
    snake = to_snake(key)
    pattern = (
        rf"^{snake}= \(a \w+\) is not used by LightningEstimator: .*{alternative}.*remove {snake}="
    )
    with pytest.raises(ConfigurationError, match=pattern):
        cls(feature_cols=["x"], label_cols=["y"], **{key: value})
    # None means "not given" (code written for horovod passes it): accepted, no Param made.
    est = cls(**{key: None})
    assert not est.hasParam(key)


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        (
            "loss_constructors",
            [len],
            r"loss_constructors= \(a list\) is not used by KerasEstimator.*pass loss=",
        ),
        (
            "train_minibatch_fn",
            len,
            r"train_minibatch_fn= .* is not used by KerasEstimator.*train_step\(\)",
        ),
    ],
)
def test_keras_refuses_the_torch_only_keywords(key, value, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        _keras()(**{key: value})


@pytest.mark.parametrize("get_cls", _classes(), ids=["torch", "keras", "lightning"])
def test_constructors_are_keyword_only(get_cls):
    cls = get_cls()
    with pytest.raises(TypeError, match="keyword"):
        cls(torch.nn.Linear(1, 1))
    signature = inspect.signature(cls)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())


def test_models_are_keyword_only_too():
    with pytest.raises(TypeError):
        TorchModel(torch.nn.Linear(1, 1))  # type: ignore[misc]
    model = TorchModel(model=torch.nn.Linear(1, 1), featureCols=["x"], labelCols=["y"])
    assert model.getFeatureCols() == ["x"]
    assert model.getOutputCols() == ["y__output"]


@pytest.mark.parametrize("get_cls", _classes(), ids=["torch", "keras", "lightning"])
def test_signature_and_parameters_doc_list_exactly_the_params_with_their_defaults(get_cls):
    cls = get_cls()
    est = cls()
    params = {to_snake(p.name): p for p in est.params}
    signature = inspect.signature(cls).parameters
    assert set(signature) == set(params)
    for name, param in params.items():
        assert signature[name].default == est.getOrDefault(param), name
    doc = cls.__init__.__doc__
    assert "Parameters\n----------\n" in doc
    documented = re.findall(r"^(\w+) : ", doc.split("----------\n", 1)[1], flags=re.M)
    assert documented == sorted(params)
    # Each entry carries the Param's doc and its Spark ML name.
    assert "batch_size : int, default 32\n    Rows per batch and rank." in doc
    assert "Spark ML Param ``batchSize``." in doc


def test_keywords_set_only_what_the_caller_passed():
    est = TorchEstimator(epochs=3, batchSize=16)  # snake_case and camelCase both work
    assert est.isSet("epochs")
    assert est.isSet("batchSize")
    assert not est.isSet("model")  # the signature's model=None default is not "set"
    assert est.getEpochs() == 3
    assert est.getBatchSize() == 16
