"""Issue 27 item 1: a rank error reaching the user leads with the rank's exception and hint."""

from __future__ import annotations

import pickle

from spark_estimators.errors import RemoteError, TrainingFailedError

CAUSE = "ValueError: the label has 3 classes\nhint: use CrossEntropyLoss"
TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: ...'


def failures():
    return {
        1: RemoteError(1, "h1", CAUSE, TRACEBACK),
        0: RemoteError(0, "h0", "CollectiveError: peer rank 1 died", "tb0"),
        2: RemoteError(2, "h2", CAUSE, TRACEBACK),
    }


def test_the_cause_comes_first_then_the_summary_then_the_traceback():
    exc = TrainingFailedError("rank 1, 2 failed (3 of 3 ranks reported a failure)", failures())
    lines = str(exc).splitlines()
    assert lines[:3] == [
        "ValueError: the label has 3 classes",
        "hint: use CrossEntropyLoss",
        "rank 1, 2 failed (3 of 3 ranks reported a failure)",
    ]
    text = str(exc)
    # the cause's traceback once, after the message; the peer's own report kept
    assert text.count('File "train.py"') == 1
    assert text.index("Traceback") > text.index("rank 1 on host 'h1' (the error above)")
    assert "rank 0 on host 'h0': CollectiveError: peer rank 1 died" in text
    assert "rank 2 on host 'h2': the same error" in text


def test_the_message_survives_pickling():
    exc = TrainingFailedError("summary", failures())
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc) and again.failed_ranks == [0, 1, 2]


def test_only_collective_errors_lead_with_the_first():
    exc = TrainingFailedError("s", {0: RemoteError(0, "h", "CollectiveError: timeout", "")})
    assert str(exc).splitlines()[0] == "CollectiveError: timeout"


def test_silent_ranks_names_the_ranks_that_sent_nothing_by_host():
    """Issue 42: a host cut off the network sends nothing; its ranks and host are named."""
    from spark_estimators.driver.service import JobState, RankSettings, Registration, silent_ranks

    hosts = ["node1", "node1", "node2", "node2", "node3", "node3"]
    state = JobState(num_proc=6)
    for index in range(6):
        host = hosts[index]
        address = f"10.0.0.{1 + index // 2}"
        state.registrations[index] = Registration(index, host, host, 100 + index, address, 0)
        # task index != rank: the names must follow the rank.
        rank = (index + 2) % 6
        state.settings[index] = RankSettings(rank, 6, rank % 2, 2, rank // 2, 3, "", 0, host)
    for rank in (2, 3, 4, 5):  # the tasks of node1 and node2 reported their peers' timeouts
        state.failures[rank] = RemoteError(rank, "x", "CollectiveError: timed out")
    assert silent_ranks(state) == "rank 0, 1 on host 'node3' (10.0.0.3)"
    state.results[0] = b""
    assert silent_ranks(state) == "rank 1 on host 'node3' (10.0.0.3)"
    state.failures[1] = RemoteError(1, "node3", "CollectiveError: timed out")
    assert silent_ranks(state) == ""
