"""The error hierarchy of spark_estimators.

Every error that can cross a process boundary (rank child -> Spark task -> driver) defines
``__reduce__`` so it survives pickling with its fields intact.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self


class SparkEstimatorsError(Exception):
    """Base class of every error raised by spark_estimators."""


class _PickledWithFields:
    """Pickles as ``type(message, *fields)``, so the attributes in ``_fields`` cross processes.

    The subclass's ``__init__`` takes the message and then the fields, in ``_fields`` order.
    """

    _fields: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[type[Self], tuple[object, ...]]:
        return (type(self), (str(self), *(getattr(self, name) for name in self._fields)))


class ConfigurationError(SparkEstimatorsError, ValueError):
    """Bad input detected in the driver before any Spark job starts."""


class StoreError(SparkEstimatorsError):
    """A Store could not read, write or list a path."""


class RunInUseError(_PickledWithFields, SparkEstimatorsError, RuntimeError):
    """Another live fit holds this ``run_id`` (its lock in the store has a fresh heartbeat).

    Parameters
    ----------
    message
        Human-readable explanation (names the run, the owner and the fix).
    run_id
        The run that is in use.
    owner
        The holder's id as written in the lock file (``host:pid:token``).
    heartbeat_age_s
        Seconds since the holder's last heartbeat.
    """

    _fields = ("run_id", "owner", "heartbeat_age_s")

    def __init__(
        self, message: str, run_id: str = "", owner: str = "", heartbeat_age_s: float = 0.0
    ):
        super().__init__(message)
        self.run_id = run_id
        self.owner = owner
        self.heartbeat_age_s = heartbeat_age_s


class CollectiveError(SparkEstimatorsError, RuntimeError):
    """A collective operation failed: not initialised, mismatched tensors, a peer died, timeout."""


class RpcError(SparkEstimatorsError):
    """A frame of the driver protocol was refused (bad signature, replay, oversized, truncated)."""


class RendezvousTimeoutError(_PickledWithFields, SparkEstimatorsError, TimeoutError):
    """Not every rank registered with the driver within ``start_timeout`` seconds.

    Parameters
    ----------
    message
        Human-readable explanation.
    registered
        The Spark partition indices that did register.
    expected
        How many tasks were expected.
    """

    _fields = ("registered", "expected")

    def __init__(self, message: str, registered: list[int] | None = None, expected: int = 0):
        super().__init__(message)
        self.registered = list(registered or [])
        self.expected = expected


class DriverUnreachableError(RendezvousTimeoutError, ConnectionError):
    """Spark tasks run but cannot connect to the driver service (a firewall, a route, an address).

    A :class:`RendezvousTimeoutError` whose cause is known: the message names the tasks' hosts
    and the driver service's address.
    """


@dataclass(frozen=True)
class RemoteError:
    """What one failed rank reported: where it ran and the traceback it raised."""

    rank: int
    host: str
    message: str
    traceback: str = ""
    exit_code: int | None = None

    def describe(self) -> str:
        """One readable paragraph: rank, host, message, exit code and the indented traceback."""
        head = f"rank {self.rank} on host {self.host!r}: {self.message}"
        if self.exit_code is not None:
            head += f" (exit code {self.exit_code})"
        if self.traceback:
            head += "\n" + _indent(self.traceback.rstrip())
        return head


class TrainingFailedError(SparkEstimatorsError, RuntimeError):
    """One or more ranks failed; ``worker_failures`` maps rank -> :class:`RemoteError`.

    The message leads with the cause: the first failing rank's exception type, message and
    hint (a rank that only lost its peer, a ``CollectiveError``, is not the cause when another
    failed), then the summary, then each rank with its traceback; a rank that failed with the
    same message as the cause is one line without its traceback.
    """

    def __init__(self, message: str, worker_failures: dict[int, RemoteError] | None = None):
        self.worker_failures = dict(worker_failures or {})
        super().__init__(_failure_report(message, self.worker_failures))
        self._message = message

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, sorted."""
        return sorted(self.worker_failures)

    def __reduce__(self) -> tuple[type[Self], tuple[object, ...]]:
        return (type(self), (self._message, self.worker_failures))


class ElasticResetLimitError(TrainingFailedError):
    """An elastic job was reset more often than ``reset_limit`` allows."""


class ModelIntegrityError(_PickledWithFields, SparkEstimatorsError):
    """A saved model or checkpoint failed its integrity check and was not unpickled.

    Raised when the digest (or the keyed HMAC) recorded at save does not match the file read at
    load, when a key is configured and the saved stage carries no HMAC, or when a checkpoint holds
    objects that ``torch.load(weights_only=True)`` refuses.

    Parameters
    ----------
    message
        Human-readable explanation naming the file and the fix.
    path
        The file that failed the check.
    expected
        The digest recorded at save (``None`` when there was none).
    found
        The digest of the file as read.
    """

    _fields = ("path", "expected", "found")

    def __init__(
        self,
        message: str,
        path: str | None = None,
        expected: str | None = None,
        found: str | None = None,
    ):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.found = found


class UnverifiedModelWarning(UserWarning):
    """A saved stage was loaded without an integrity check (saved before digests were recorded)."""


class NoModelKeyWarning(UserWarning):
    """A saved stage was loaded without a model key: its SHA-256 was checked, not who wrote it.

    A model signed with a key whose signature was removed and digest rewritten looks exactly like
    an unsigned one, so every load without a key says so. Set the key the models are signed with
    (``SPARK_ESTIMATORS_MODEL_KEY`` or ``key=``); if you do not sign models,
    ``warnings.filterwarnings("ignore", category=NoModelKeyWarning)`` silences it.
    """


def _failure_report(message: str, failures: dict[int, RemoteError]) -> str:
    """The cause's message first, then ``message`` and each rank (see TrainingFailedError)."""
    if not failures:
        return message
    ordered = [f for _, f in sorted(failures.items())]
    cause = next((f for f in ordered if not f.message.startswith("CollectiveError")), ordered[0])
    lines = [cause.message.rstrip() or f"rank {cause.rank} failed", message]
    for f in ordered:
        if f is cause:
            head = f"rank {f.rank} on host {f.host!r} (the error above)"
            if f.exit_code is not None:
                head += f", exit code {f.exit_code}"
            lines.append(head + (":\n" + _indent(f.traceback.rstrip()) if f.traceback else ""))
        elif f.message == cause.message and f.exit_code == cause.exit_code:
            lines.append(f"rank {f.rank} on host {f.host!r}: the same error")
        else:
            lines.append(f.describe())
    return "\n".join(lines)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


__all__ = [
    "CollectiveError",
    "ConfigurationError",
    "DriverUnreachableError",
    "ElasticResetLimitError",
    "ModelIntegrityError",
    "NoModelKeyWarning",
    "RemoteError",
    "RendezvousTimeoutError",
    "RpcError",
    "RunInUseError",
    "SparkEstimatorsError",
    "StoreError",
    "TrainingFailedError",
    "UnverifiedModelWarning",
]


def did_you_mean(missing: Sequence[str], columns: Sequence[str]) -> str:
    """``" (did you mean 'features'?)"`` for the missing names close to an existing column."""
    hints = []
    for name in missing:
        lower = {c.lower(): c for c in columns}
        close = [lower[name.lower()]] if name.lower() in lower else []
        close = close or difflib.get_close_matches(name, list(columns), n=1, cutoff=0.6)
        if close:
            hints.append(f"{close[0]!r} for {name!r}" if len(missing) > 1 else repr(close[0]))
    return f" (did you mean {', '.join(hints)}?)" if hints else ""
