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
