"""The timeline: a per-rank Chrome trace of every collective op and its negotiation.

Enabled by ``init(timeline=path)``, ``spark_estimators.run(..., timeline=path)``,
``python -m spark_estimators.launch --timeline path``, or the environment variable
``SPARK_ESTIMATORS_TIMELINE`` (Horovod's ``HOROVOD_TIMELINE`` works too); also started and
stopped at run time with :func:`start_timeline` / :func:`stop_timeline`, as in Horovod. The
value ``DYNAMIC`` means what it means in Horovod: no timeline at ``init()``, one started later by
:func:`start_timeline`.

Each rank writes its own file: ``path`` with ``{rank}`` replaced, or else ``.rank<N>`` added
before the extension (``/tmp/tl.json`` -> ``/tmp/tl.rank0.json``, ``/tmp/tl.rank1.json``).
The file is Chrome's trace-event JSON (``{"traceEvents": [...]}``): open it in
``chrome://tracing`` or https://ui.perfetto.dev. :func:`merge` joins the ranks' files into one.

What is in it: one process row per rank (``pid`` = global rank, named ``rank N``) and one thread row
per tensor name, as in Horovod's timeline. An asynchronous op (or one submitted while others run)
first gets a ``QUEUE`` event: its wait in the engine's queue. Then each op adds two complete
(``"X"``) events: ``NEGOTIATE_<OP>`` (the negotiation round in which the ranks agree on the op,
which is where a rank waits for slower peers) and ``<OP>`` (the data movement; ``args.inline`` tells
whether the data travelled inside the negotiation). ``args`` also carry the process set id, the
dtype, the shape description, ``fused`` (the number of ops of a fused round, each of which gets
these events) and, for a failed op, the error. Timestamps are wall-clock microseconds, so the files
of several ranks line up on one machine.

The file is valid JSON after every flush (events are written in batches, at least once a
second while ops run, and when the rank ends), so a rank that dies keeps what it flushed.
"""

from __future__ import annotations

from spark_estimators.collective.runtime import engine as _engine
from spark_estimators.collective.runtime import process_sets as _sets
from spark_estimators.collective.runtime.timeline import Timeline, flush_all, merge, rank_path


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this rank's timeline to ``file_path`` (Horovod's ``hvd.start_timeline``).

    ``mark_cycles`` is accepted for Horovod compatibility and marks nothing: each op's ``QUEUE``
    and ``NEGOTIATE_<OP>`` events show its wait. Every rank should call it; each writes its own
    file. With ``HOROVOD_TIMELINE=DYNAMIC`` this is how the timeline starts (``init()`` starts
    none).
    """
    engine = _engine.require("start_timeline")
    if engine.timeline is not None:
        engine.timeline.close()
    timeline = Timeline(file_path, engine.backend.rank)
    engine.timeline = timeline
    for ps in _sets.registered():
        if ps._engine is not None:
            ps._engine.timeline = timeline


def stop_timeline() -> None:
    """Stop the timeline started by ``init(timeline=...)`` or :func:`start_timeline`."""
    engine = _engine.require("stop_timeline")
    timeline, engine.timeline = engine.timeline, None
    for ps in _sets.registered():
        if ps._engine is not None:
            ps._engine.timeline = None
    if timeline is not None:
        timeline.close()


__all__ = ["Timeline", "flush_all", "merge", "rank_path", "start_timeline", "stop_timeline"]
