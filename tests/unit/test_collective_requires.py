"""The framework adapters' import check names the pip extra (collective/requires.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spark_estimators.collective.requires import requires_extra


def test_a_missing_module_names_the_adapter_and_the_extra():
    with (
        pytest.raises(ImportError) as info,
        requires_extra("my_adapter", "NoSuchFramework", "nosuch"),
    ):
        import spark_estimators_no_such_framework  # noqa: F401
    assert str(info.value) == (
        "my_adapter needs NoSuchFramework: pip install 'spark-estimators[nosuch]'"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert info.value.__cause__.name == "spark_estimators_no_such_framework"


def test_an_installed_module_is_imported_and_other_errors_pass_through():
    with requires_extra("my_adapter", "NumPy", "numpy"):
        import numpy
    assert numpy.ones(2).sum() == 2.0
    with pytest.raises(ValueError, match="not an import"), requires_extra("a", "b", "c"):
        raise ValueError("not an import error")


def test_the_keras_adapter_without_tensorflow_says_what_to_install():
    # A fresh interpreter where importing tensorflow fails, as on an install without the extra.
    code = (
        "import sys\n"
        "sys.modules['tensorflow'] = None\n"
        "try:\n"
        "    import spark_estimators.collective.keras\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == (
        "spark_estimators.collective.keras needs TensorFlow and Keras 3: "
        "pip install 'spark-estimators[keras]'"
    ), proc.stderr
