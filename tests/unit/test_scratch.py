"""The rank scratch dir: made by the task under the rank's TMPDIR, removed with what it lists."""

from __future__ import annotations

import os
import tempfile

from spark_estimators import envvars as ev
from spark_estimators.task.scratch import (
    create_scratch,
    make_temp_dir,
    remove_at_rank_exit,
    remove_scratch,
    scratch_root,
)


def test_scratch_lives_under_the_ranks_tmpdir_and_goes_with_what_it_lists(tmp_path, monkeypatch):
    env = {"TMPDIR": str(tmp_path)}
    scratch = create_scratch(env)
    assert scratch is not None and os.path.dirname(scratch) == str(tmp_path)
    assert env[ev.RANK_SCRATCH] == scratch
    # Inside the rank: temp dirs go into the scratch dir, fixed paths are registered.
    monkeypatch.setenv(ev.RANK_SCRATCH, scratch)
    assert scratch_root() == scratch
    made = make_temp_dir("se-tb-")
    assert os.path.dirname(made) == scratch and os.path.basename(made).startswith("se-tb-")
    fixed = tmp_path / "spark_estimators-lightning-run_1"
    (fixed / "sub").mkdir(parents=True)
    remove_at_rank_exit(str(fixed))
    # The task, after the rank exited (however it ended):
    remove_scratch(scratch)
    assert sorted(os.listdir(tmp_path)) == []
    remove_scratch(scratch)  # idempotent


def test_outside_a_rank_the_plain_temp_dir_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv(ev.RANK_SCRATCH, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert scratch_root() is None
    made = make_temp_dir("se-x-")
    assert os.path.dirname(made) == str(tmp_path)
    remove_at_rank_exit(made)  # no scratch: nothing registered, nothing written
    assert os.listdir(tmp_path) == [os.path.basename(made)]


def test_a_missing_tmpdir_falls_back_to_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {"TMPDIR": str(tmp_path / "does-not-exist")}
    scratch = create_scratch(env)
    assert scratch is not None and os.path.dirname(scratch) == str(tmp_path)
    remove_scratch(scratch)
    assert os.listdir(tmp_path) == []
