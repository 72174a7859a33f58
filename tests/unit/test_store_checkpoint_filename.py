"""``Store.get_checkpoint_filename`` (horovod's name, issue 44 item 2)."""

from __future__ import annotations

import pytest

from spark_estimators.store import LocalStore
from spark_estimators.store.base import join_path


def test_the_checkpoint_filename_names_the_keras_estimators_checkpoint(tmp_path):
    store = LocalStore(str(tmp_path))
    assert store.get_checkpoint_filename() == "checkpoint.keras"
    pytest.importorskip("keras")
    from spark_estimators.keras.callbacks import checkpoint_path

    expected = join_path(store.get_checkpoint_path("run-1"), store.get_checkpoint_filename())
    assert checkpoint_path(store, "run-1") == expected  # where the Keras estimator writes it
