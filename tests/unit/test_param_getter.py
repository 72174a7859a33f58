"""``ParamGetter``: one statement declares a Param and its typed, documented getter."""

from __future__ import annotations

import inspect
from typing import ClassVar

import pytest
from pyspark.ml.param import Param, TypeConverters

from spark_estimators.core.params import DeclaredParams, EstimatorParams, LaunchParams
from spark_estimators.core.params.base import ParamGetter, to_int_or_none


class _Retries(DeclaredParams):
    getMaxRetries = ParamGetter("retries before giving up", to_int_or_none)
    getPolicy: ParamGetter[dict[str, int] | None] = ParamGetter("retry policy")
    _defaults: ClassVar[dict[str, object]] = {"maxRetries": 3, "policy": None}


def test_the_param_takes_the_getter_name_without_get():
    assert isinstance(_Retries.maxRetries, Param)
    assert _Retries.maxRetries.name == "maxRetries"
    assert _Retries.maxRetries.doc == "retries before giving up"
    assert _Retries.maxRetries.typeConverter is to_int_or_none
    assert [p.name for p in _Retries().params] == ["maxRetries", "policy"]


def test_the_getter_reads_the_value_or_the_default():
    stage = _Retries()
    assert stage.getMaxRetries() == 3
    stage.setMaxRetries(7.0)  # generated setter, converted by the Param's converter
    assert stage.getMaxRetries() == 7 and isinstance(stage.getMaxRetries(), int)
    assert stage.setPolicy({"backoff": 2}).getPolicy() == {"backoff": 2}


def test_the_getter_is_a_documented_function_with_its_return_type():
    getter = _Retries.__dict__["getMaxRetries"]
    assert inspect.isfunction(getter)
    assert getter.__doc__ == "Gets the value of ``maxRetries`` or its default value."
    assert getter.__qualname__ == "_Retries.getMaxRetries"
    # from the converter's return annotation, or from the declared ParamGetter[...] type
    assert inspect.signature(getter).return_annotation == "int | None"
    assert inspect.signature(_Retries.getPolicy).return_annotation == "dict[str, int] | None"
    assert inspect.signature(LaunchParams.getStartTimeout).return_annotation == "float"
    assert inspect.signature(LaunchParams.getStore).return_annotation == "Store | None"


def test_the_estimator_params_keep_pysparks_getters():
    params = EstimatorParams()
    assert params.getBatchSize() == 32 and params.getReader() == "arrow"
    assert EstimatorParams.getBatchSize.__doc__ == (
        "Gets the value of ``batchSize`` or its default value."
    )


def test_a_getter_named_otherwise_is_refused_at_class_creation():
    with pytest.raises((TypeError, RuntimeError)) as info:

        class _Bad(DeclaredParams):
            maxRetries = ParamGetter("retries", TypeConverters.toInt)

    error = info.value.__cause__ or info.value  # Python 3.11 wraps it in a RuntimeError
    assert isinstance(error, TypeError)
    assert "get<ParamName>, not 'maxRetries'" in str(error)
