"""What every internal op takes from the public function that called it: :class:`Call`."""

from __future__ import annotations

from dataclasses import dataclass

from spark_estimators.collective.runtime.process_sets import ProcessSet


@dataclass(frozen=True, slots=True)
class Call:
    """How the caller asked for an op, the same for every op (built once by each public function).

    Parameters
    ----------
    name
        The caller's name for the op; ``None``: a generated one, left out of the signature the
        ranks agree on.
    blocking
        Run the op in the caller's thread instead of queueing it on the engine thread.
    process_set
        Run the op among this set's members only (``None``: every rank).
    """

    name: str | None
    blocking: bool = False
    process_set: ProcessSet | None = None
