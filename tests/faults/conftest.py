"""Fixtures of the fault-injection suite (helpers live in ``faultlib``)."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture
def clock(tmp_path: pathlib.Path) -> pathlib.Path:
    """Path of the clock file the faulty rank writes just before it fails."""
    return tmp_path / "fault-clock"
