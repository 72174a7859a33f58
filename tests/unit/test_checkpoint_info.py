"""core/checkpoint.py: the one checkpoint.json schema, and the files older versions wrote."""

from __future__ import annotations

import json
import types

import pytest

from spark_estimators.core.checkpoint import (
    CheckpointInfo,
    info_path,
    read_info,
    start_fields,
    store_path,
    write_info,
)
from spark_estimators.core.rank import epoch_steps
from spark_estimators.errors import ConfigurationError
from spark_estimators.store import LocalStore

HISTORY = [{"epoch": 0, "loss": 0.75}, {"epoch": 1, "loss": 0.5, "val_loss": 0.625}]

# The info files as the code before the shared schema wrote them (json.dumps of these dicts):
# torch/remote.py _save_checkpoint (8aaac3b), keras/remote.py StoreCheckpoint (8aaac3b; before
# 75bdc62's parent it had no "size"), lightning/callbacks.py StoreCheckpoint.publish (89570f0).
OLD_FILES = {
    "torch": ({"epoch": 1, "history": HISTORY}, None, {}),
    "keras": ({"epoch": 1, "size": 3, "history": HISTORY}, 3, {}),
    "keras-before-size": ({"epoch": 1, "history": HISTORY}, None, {}),
    "lightning": (
        {
            "epoch": 1,
            "history": HISTORY,
            "checkpoint": "last_epoch.ckpt",
            "framework": "lightning",
        },
        None,
        {"checkpoint": "last_epoch.ckpt"},
    ),
}


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def _write_raw(store, run_id, data):
    store.write_bytes_atomic(info_path(store, run_id), json.dumps(data).encode("utf-8"))


def test_round_trip_through_json_and_the_store(store):
    info = CheckpointInfo(
        framework="keras",
        epoch=4,
        num_proc=2,
        history=tuple(HISTORY),
        fingerprint="ab" * 32,
        extra={"note": [1, 2]},
    )
    assert CheckpointInfo.from_json(info.to_json()) == info
    assert read_info(store, "r1") is None
    write_info(store, "r1", info)
    assert info_path(store, "r1").endswith("/checkpoint.json")
    assert read_info(store, "r1", "keras") == info
    raw = json.loads(store.read_text(info_path(store, "r1")))
    assert sorted(raw) == [
        "epoch",
        "extra",
        "fingerprint",
        "framework",
        "history",
        "num_proc",
        "schema",
    ]
    assert raw["schema"] == 1 and raw["num_proc"] == 2 and raw["history"][1]["val_loss"] == 0.625


def test_every_checkpoint_path_is_built_in_the_run_checkpoint_dir(store, tmp_path):
    directory = store_path(store, "r1")
    assert directory == str(tmp_path / "store" / "runs" / "r1" / "checkpoints")
    assert store_path(store, "r1", "checkpoint.pt") == directory + "/checkpoint.pt"
    assert info_path(store, "r1") == directory + "/checkpoint.json"
    store.write_bytes_atomic(store_path(store, "r1", "last_epoch.ckpt"), b"w")
    assert store.listdir(directory) == ["last_epoch.ckpt"]


@pytest.mark.parametrize("name", sorted(OLD_FILES))
def test_old_files_still_hot_start(store, name):
    data, num_proc, extra = OLD_FILES[name]
    framework = name.split("-")[0]
    _write_raw(store, "old", data)
    info = read_info(store, "old", framework)
    assert info is not None
    assert info.epoch == 1 and list(info.history) == HISTORY
    assert info.num_proc == num_proc and dict(info.extra) == extra
    assert info.fingerprint is None
    # What the driver hands the ranks (core/estimator.py _spec_fields).
    assert start_fields(info) == {"start_epoch": 2, "history": HISTORY}


def test_no_info_starts_at_epoch_zero():
    assert start_fields(None) == {"start_epoch": 0, "history": []}


@pytest.mark.parametrize(
    ("data", "framework"),
    [
        ({"epoch": 0, "history": [], "framework": "lightning"}, "torch"),
        ({"epoch": 0, "history": [], "framework": "torch"}, "keras"),
        ({"epoch": 0, "history": []}, "lightning"),  # an untagged file is torch's or keras's
    ],
)
def test_another_frameworks_run_is_refused_in_the_driver(store, data, framework):
    _write_raw(store, "other", data)
    with pytest.raises(ConfigurationError, match="another estimator.*store.delete_run"):
        read_info(store, "other", framework)


@pytest.mark.parametrize("text", ["[]", '{"history": []}', '{"epoch": 1, "history": {}}', "{"])
def test_malformed_info_is_a_clear_error(store, text):
    store.write_bytes_atomic(info_path(store, "bad"), text.encode("utf-8"))
    with pytest.raises(ConfigurationError, match="is not a checkpoint info"):
        read_info(store, "bad")


@pytest.mark.parametrize(
    ("reader_steps", "limit", "multiple", "expected"),
    [
        (10, None, 1, 10),
        (10, 4, 1, 4),
        (0, 4, 1, 4),
        (10, None, 3, 12),
        (9, None, 3, 9),
        (2, None, 3, 3),
    ],
)
def test_epoch_steps(reader_steps, limit, multiple, expected):
    reader = types.SimpleNamespace(steps_per_epoch=reader_steps)
    assert epoch_steps(reader, limit, multiple) == expected
