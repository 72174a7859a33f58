"""``getHistory()``: the per-epoch list that also answers horovod's ``history['val_loss']``."""

from __future__ import annotations

import json
import pickle

import pytest

from spark_estimators.core.history import History

EPOCHS = [
    {"epoch": 0, "loss": 0.9, "mae": 0.7},
    {"epoch": 1, "loss": 0.4, "mae": 0.5, "val_loss": 0.45},
]


def test_epochs_by_position_and_metrics_by_name():
    h = History(EPOCHS)
    assert len(h) == 2 and h[-1]["loss"] == 0.4 and h[0] == EPOCHS[0]
    assert h["loss"] == [0.9, 0.4]
    assert min(h["loss"]) == 0.4
    assert h["val_loss"] == [None, 0.45]  # an epoch without the metric
    assert h[:1] == EPOCHS[:1]
    assert [e["epoch"] for e in h] == [0, 1]


def test_dict_methods_give_horovods_form():
    h = History(EPOCHS)
    assert h.keys() == ["loss", "mae", "val_loss"]
    assert (
        dict(h.items())
        == h.as_dict()
        == {
            "loss": [0.9, 0.4],
            "mae": [0.7, 0.5],
            "val_loss": [None, 0.45],
        }
    )
    assert h.values() == [[0.9, 0.4], [0.7, 0.5], [None, 0.45]]
    assert "val_loss" in h and "val_mae" not in h
    assert EPOCHS[0] in h
    assert h.get("val_mae") is None and h.get("val_mae", []) == []


def test_unknown_metric_names_the_known_ones():
    with pytest.raises(KeyError, match=r"no metric 'val_mae'.*\['loss', 'mae', 'val_loss'\]"):
        History(EPOCHS)["val_mae"]


def test_equal_to_plain_lists_and_survives_json_and_pickle():
    h = History(EPOCHS)
    assert h == EPOCHS
    assert json.loads(json.dumps(h)) == EPOCHS
    again = pickle.loads(pickle.dumps(h))
    assert isinstance(again, History) and again["mae"] == [0.7, 0.5]
    # A copy: editing the history does not edit the model's.
    h[0]["loss"] = 5.0
    assert EPOCHS[0]["loss"] == 0.9
