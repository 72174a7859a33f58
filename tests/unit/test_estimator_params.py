"""Every estimator param has pyspark-style accessors; horovod params without effect are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pyspark.ml.param import Param  # noqa: E402

from spark_estimators.errors import ConfigurationError  # noqa: E402
from spark_estimators.torch import TorchEstimator  # noqa: E402


def _estimators():
    classes = [TorchEstimator]
    try:
        from spark_estimators.lightning import LightningEstimator

        classes.append(LightningEstimator)
    except ImportError:  # pragma: no cover - depends on the install
        pass
    return classes


def _net():
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize("cls", _estimators(), ids=lambda c: c.__name__)
def test_every_param_has_a_chainable_setter_and_a_getter(cls):
    est = cls()
    names = [p.name for p in est.params]
    assert {"shuffleBufferSize", "readerPoolType", "mpStartMethod"} <= set(names)
    for name in names:
        suffix = name[0].upper() + name[1:]
        assert callable(getattr(est, "get" + suffix)), name
        param: Param = est.getParam(name)
        if param.typeConverter.__name__ != "identity":
            continue  # typed params are checked below with real values
        sentinel = object()
        assert getattr(est, "set" + suffix)(sentinel) is est, name
        assert est.getOrDefault(name) is sentinel, name


def test_typed_setters_convert_and_horovod_spellings_work():
    est = TorchEstimator()
    assert est.setShuffleBufferSize(1000).getShuffleBufferSize() == 1000
    assert est.setShufflingBufferSize(500).getShufflingBufferSize() == 500
    assert est.setTrainReaderNumWorker(3).getTrainReaderNumWorkers() == 3
    assert est.setValReaderNumWorker(4).getValReaderNumWorker() == 4
    assert est.setInMemoryCacheAll(True).getInmemoryCacheAll() is True
    assert est.setLossWeights([0.5]).getLossWeights() == [0.5]
    assert est.setSampleWeightCol("w").getSampleWeightCol() == "w"
    assert est.setCompressSparseCols(True).getCompressSparseCols() is True
    assert est.setVerbose(0).setEpochs(3).getEpochs() == 3
    assert est.setModel("m").getModel() == "m"  # generated accessors on identity params too
    assert est.setTrainMinibatchFn(len).getTrainMinibatchFn() is len


def _torch_estimator(**kw):
    net, opt = _net()
    return TorchEstimator(
        num_proc=1,
        model=net,
        optimizer=opt,
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        **kw,
    )


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"reader_pool_type": "process"},
            r"reader_pool_type='process' is not supported.*"
            r"train_reader_num_workers",
        ),
        ({"mp_start_method": "spawn"}, r"mp_start_method='spawn' is not supported.*fresh process"),
        (
            {"transformation_edit_fields": [("z", float, (), False)]},
            r"transformation_edit_fields=.* is not supported.*transformation_fn",
        ),
        ({"transformation_removed_fields": ["x"]}, r"transformation_removed_fields=\['x'\]"),
        ({"shuffle_buffer_size": -1}, r"shuffle_buffer_size=-1 is invalid"),
        ({"log_to_mlflow": "yes"}, r"log_to_mlflow='yes' is invalid: expected None, True or False"),
    ],
)
def test_unsupported_horovod_params_are_refused_in_the_driver(kwargs, pattern):
    with pytest.raises(ConfigurationError, match=pattern):
        _torch_estimator(**kwargs)._validate_params(["x", "y"])


def test_horovod_defaults_of_those_params_are_accepted():
    est = _torch_estimator(reader_pool_type="thread", mp_start_method=None, shuffle_buffer_size=0)
    est._validate_params(["x", "y"])
    assert est.getReaderPoolType() == "thread"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"loader_num_epochs": 2}, r"loader_num_epochs=2 is not supported.*train_steps_per_epoch"),
        ({"data_module": object()}, r"data_module=.* is not supported.*transformation_fn"),
        ({"debug_data_loader": True}, r"debug_data_loader=True is not supported"),
        ({"train_async_data_loader_queue_size": 8}, r"train_async_data_loader_queue_size=8"),
        ({"val_async_data_loader_queue_size": 8}, r"val_async_data_loader_queue_size=8"),
    ],
)
def test_lightning_only_horovod_params_are_refused(kwargs, pattern):
    pl = pytest.importorskip("pytorch_lightning")
    from spark_estimators.lightning import LightningEstimator

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)

    est = LightningEstimator(
        num_proc=1, model=Module(), feature_cols=["x"], label_cols=["y"], **kwargs
    )
    with pytest.raises(ConfigurationError, match=pattern):
        est._validate_params(["x", "y"])


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("data_module", object, "built-in reader.*transformation_fn"),
        ("continuous_cols", ["x"], "feature_cols"),
        ("categorical_cols", ["c"], "StringIndexer"),
    ],
)
def test_horovod_data_module_keywords_name_the_alternative(key, value, pattern):
    with pytest.raises(ConfigurationError, match=f"horovod's {key}=.*no equivalent.*{pattern}"):
        TorchEstimator(**{key: value})
    # horovod's defaults mean "not used": accepted.
    TorchEstimator(data_module=None, continuous_cols=None, categorical_cols=None)


def test_keras_prefetch_keyword_names_the_alternative():
    pytest.importorskip("keras")
    from spark_estimators.keras import KerasEstimator

    KerasEstimator(tensorflow_dataset_prefetch_buffer_size=0)
    with pytest.raises(ConfigurationError, match="reader_num_workers"):
        KerasEstimator(tensorflow_dataset_prefetch_buffer_size=4)


def test_unknown_keyword_suggests_only_this_estimators_names():
    # data_module is a Lightning param: TorchEstimator must not suggest it back.
    with pytest.raises(ConfigurationError) as info:
        TorchEstimator(debug_data_loadr=True)
    assert "debug_data_loader" not in str(info.value)
