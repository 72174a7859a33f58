"""Horovod's environment variables: the honoured ones map to our settings, ours win, the
ignored ones are reported with a reason; Adasum's numpy tree; timeline file naming."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spark_estimators import envvars as ev
from spark_estimators.collective.api import timeline
from spark_estimators.collective.runtime import adasum, settings
from spark_estimators.errors import ConfigurationError

HOROVOD_VARS = [
    ev.HOROVOD_TIMELINE, ev.HOROVOD_FUSION_THRESHOLD, ev.HOROVOD_GLOO_TIMEOUT_SECONDS,
    ev.HOROVOD_START_TIMEOUT, ev.HOROVOD_SPARK_START_TIMEOUT, ev.HOROVOD_HOSTNAME,
    ev.TIMELINE, ev.FUSION_THRESHOLD, ev.COLLECTIVE_TIMEOUT, ev.START_TIMEOUT, ev.SE_HOSTNAME,
    ev.HOROVOD_CYCLE_TIME, ev.CYCLE_TIME, *ev.IGNORED_HOROVOD, ev.HOROVOD_AUTOTUNE,
    ev.HOROVOD_AUTOTUNE_LOG, ev.HOROVOD_HIERARCHICAL_ALLREDUCE, ev.HOROVOD_HIERARCHICAL_ALLGATHER,
]  # fmt: skip


@pytest.fixture
def env(monkeypatch):
    for name in HOROVOD_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_horovod_variables_set_our_settings(env):
    env.setenv(ev.HOROVOD_GLOO_TIMEOUT_SECONDS, "33")
    env.setenv(ev.HOROVOD_SPARK_START_TIMEOUT, "44")
    env.setenv(ev.HOROVOD_FUSION_THRESHOLD, "1048576")
    env.setenv(ev.HOROVOD_TIMELINE, "/tmp/h.json")
    env.setenv(ev.HOROVOD_HOSTNAME, "hv-host")
    assert settings.collective_timeout() == 33.0
    assert settings.start_timeout() == 44.0
    assert settings.fusion_threshold() == 1048576
    assert settings.timeline_path() == "/tmp/h.json"
    assert settings.topology_from_env().hostname == "hv-host"
    env.setenv(ev.HOROVOD_START_TIMEOUT, "55")
    env.delenv(ev.HOROVOD_SPARK_START_TIMEOUT)
    assert settings.start_timeout() == 55.0


def test_our_variables_and_arguments_win_over_horovods(env):
    env.setenv(ev.HOROVOD_GLOO_TIMEOUT_SECONDS, "33")
    env.setenv(ev.COLLECTIVE_TIMEOUT, "12")
    env.setenv(ev.HOROVOD_FUSION_THRESHOLD, "1048576")
    env.setenv(ev.FUSION_THRESHOLD, "2048")
    env.setenv(ev.HOROVOD_TIMELINE, "/tmp/h.json")
    env.setenv(ev.TIMELINE, "/tmp/ours.json")
    assert settings.collective_timeout() == 12.0
    assert settings.collective_timeout(5) == 5.0
    assert settings.fusion_threshold() == 2048
    assert settings.fusion_threshold(7) == 7
    assert settings.timeline_path() == "/tmp/ours.json"
    assert settings.timeline_path("/tmp/arg.json") == "/tmp/arg.json"


def test_bad_horovod_values_name_the_variable(env):
    env.setenv(ev.HOROVOD_GLOO_TIMEOUT_SECONDS, "soon")
    with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS='soon'"):
        settings.collective_timeout()
    env.setenv(ev.HOROVOD_FUSION_THRESHOLD, "big")
    with pytest.raises(ConfigurationError, match="HOROVOD_FUSION_THRESHOLD='big'"):
        settings.fusion_threshold()


def test_ignored_horovod_variables_come_with_a_reason(env):
    assert settings.ignored_horovod_variables() == {}
    env.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    env.setenv("HOROVOD_CYCLE_TIME", "3.5")  # honoured since issue 25: not listed
    env.setenv("HOROVOD_CACHE_CAPACITY", "1024")  # honoured since issue 45: not listed
    for name in (
        "HOROVOD_AUTOTUNE",
        "HOROVOD_AUTOTUNE_LOG",
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
        "HOROVOD_HIERARCHICAL_ALLGATHER",
    ):  # honoured since issue 46: not listed
        env.setenv(name, "1")
    ignored = settings.ignored_horovod_variables()
    assert sorted(ignored) == ["HOROVOD_TIMELINE_MARK_CYCLES"]
    assert "cycles are not marked" in ignored["HOROVOD_TIMELINE_MARK_CYCLES"]


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("no", False)]
)
def test_horovod_switches(env, raw, value):
    env.setenv("HOROVOD_HIERARCHICAL_ALLGATHER", raw)
    assert settings.hierarchical() == (None, value)
    env.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe")
    with pytest.raises(ConfigurationError, match="HOROVOD_HIERARCHICAL_ALLREDUCE='maybe' must be"):
        settings.hierarchical()


def test_adasum_tree_matches_the_formula():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    np.testing.assert_allclose(adasum.combine(a, b), a + b)  # orthogonal: the sum
    np.testing.assert_allclose(adasum.combine(a, 3 * a), 2 * a)  # parallel: the average
    c, d = np.array([1.0, 1.0]), np.array([1.0, 0.0])
    dot = 1.0
    want = (1 - dot / (2 * 2.0)) * c + (1 - dot / (2 * 1.0)) * d
    np.testing.assert_allclose(adasum.combine(c, d), want)
    np.testing.assert_allclose(adasum.combine(np.zeros(2), d), d)  # a zero vector: coefficient 1
    vs = [np.random.default_rng(i).standard_normal(6) for i in range(4)]
    np.testing.assert_allclose(
        adasum.tree_reduce(vs),
        adasum.combine(adasum.combine(vs[0], vs[1]), adasum.combine(vs[2], vs[3])),
    )
    with pytest.raises(ConfigurationError, match="power-of-two number of vectors, got 3"):
        adasum.tree_reduce(vs[:3])


def test_timeline_paths(tmp_path):
    assert timeline.rank_path("/x/tl.json", 1) == "/x/tl.rank1.json"
    assert timeline.rank_path("/x/tl", 0) == "/x/tl.rank0.json"
    assert timeline.rank_path("/x/tl-{rank}.trace", 3) == "/x/tl-3.trace"
    assert timeline.rank_path(str(tmp_path), 2) == str(tmp_path / "timeline.rank2.json")


def test_timeline_file_is_valid_json_after_each_flush(tmp_path):
    tl = timeline.Timeline(str(tmp_path / "t.json"), 0)
    assert json.loads((tmp_path / "t.rank0.json").read_text())["traceEvents"][0]["args"] == {
        "name": "rank 0"
    }
    tl.record("grad", "ALLREDUCE", 0, 1_000, 3_000, 10_000, {"inline": True})
    tl.flush()
    events = json.loads((tmp_path / "t.rank0.json").read_text())["traceEvents"]
    assert [e["name"] for e in events] == [
        "process_name", "thread_name", "NEGOTIATE_ALLREDUCE", "ALLREDUCE",
    ]  # fmt: skip
    assert events[2]["dur"] == 2.0 and events[3]["dur"] == 7.0  # microseconds
    tl.record("w", "BROADCAST", 1, 0, 0, 0, {})
    tl.close()
    events = json.loads((tmp_path / "t.rank0.json").read_text())["traceEvents"]
    assert [e["name"] for e in events][-2:] == ["NEGOTIATE_BROADCAST", "BROADCAST"]
    assert events[-1]["args"]["process_set"] == 1
    merged = timeline.merge([str(tmp_path / "t.rank0.json")] * 2, str(tmp_path / "m.json"))
    assert len(json.loads(open(merged).read())["traceEvents"]) == 2 * len(events)


@pytest.mark.parametrize("raw", ["-1", "many", "2.5"])
def test_a_bad_horovod_cache_capacity_is_refused_naming_it(env, raw):
    from spark_estimators.collective.runtime import cache

    env.setenv("HOROVOD_CACHE_CAPACITY", raw)
    with pytest.raises(ConfigurationError, match=rf"CACHE_CAPACITY='{raw}' must be a whole number"):
        cache.capacity()
