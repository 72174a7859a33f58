"""Limits of the driver's servers and the rate-limited log of the connections they refuse.

:class:`RpcLimits` bounds what an unauthenticated peer can cost the RPC server
(:mod:`spark_estimators.driver.rpc`) and the PMI server (:mod:`spark_estimators.driver.pmi`);
:class:`RefusalLog` counts refused connections and logs them as one WARNING per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from spark_estimators import envvars as ev
from spark_estimators.envvars import env_float, env_int

__all__ = ["RefusalLog", "RpcLimits"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RpcLimits:
    """What a driver service accepts from the network before and after authentication.

    Parameters
    ----------
    auth_timeout
        Seconds a new connection has to complete the handshake
        (env ``SPARK_ESTIMATORS_RPC_AUTH_TIMEOUT``).
    frame_timeout
        Seconds a started frame has to arrive completely, plus one second per MiB
        (env ``SPARK_ESTIMATORS_RPC_FRAME_TIMEOUT``); also bounds sending a reply.
    max_unauthenticated
        Connections allowed in the handshake at once; more are closed at once
        (env ``SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED``).
    max_unauthenticated_per_host
        Of those, how many may come from one IP address; more from it are closed at once, so
        one host cannot hold every slot (env
        ``SPARK_ESTIMATORS_RPC_MAX_UNAUTHENTICATED_PER_HOST``).
    log_interval
        Refused connections are logged as one WARNING per this many seconds
        (env ``SPARK_ESTIMATORS_RPC_LOG_INTERVAL``).
    """

    auth_timeout: float = 10.0
    frame_timeout: float = 60.0
    max_unauthenticated: int = 64
    max_unauthenticated_per_host: int = 16
    log_interval: float = 60.0

    def __post_init__(self) -> None:
        names = {
            "auth_timeout": ev.RPC_AUTH_TIMEOUT,
            "frame_timeout": ev.RPC_FRAME_TIMEOUT,
            "max_unauthenticated": ev.RPC_MAX_UNAUTHENTICATED,
            "max_unauthenticated_per_host": ev.RPC_MAX_UNAUTHENTICATED_PER_HOST,
            "log_interval": ev.RPC_LOG_INTERVAL,
        }
        for name, env in names.items():
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RpcLimits.{name} must be > 0, got {value!r} (env {env})")

    @classmethod
    def from_env(cls) -> RpcLimits:
        """The defaults, overridden by the ``SPARK_ESTIMATORS_RPC_*`` environment variables."""
        d = cls()
        return cls(
            auth_timeout=env_float(ev.RPC_AUTH_TIMEOUT, d.auth_timeout),
            frame_timeout=env_float(ev.RPC_FRAME_TIMEOUT, d.frame_timeout),
            max_unauthenticated=env_int(ev.RPC_MAX_UNAUTHENTICATED, d.max_unauthenticated),
            max_unauthenticated_per_host=env_int(
                ev.RPC_MAX_UNAUTHENTICATED_PER_HOST, d.max_unauthenticated_per_host
            ),
            log_interval=env_float(ev.RPC_LOG_INTERVAL, d.log_interval),
        )


class RefusalLog:
    """Counts refused connections by reason and logs them as one WARNING per ``interval``.

    The first refusal is logged at once; later ones are summed up in the next WARNING, written
    at the first refusal after ``interval`` seconds or by :meth:`flush` (when the server closes).
    """

    def __init__(self, what: str, interval: float, log: logging.Logger = logger):
        self.what = what
        self.interval = interval
        self.total = 0
        self.counts: Counter[str] = Counter()
        self._log = log
        self._lock = threading.Lock()
        self._unlogged: Counter[str] = Counter()
        self._last: tuple[str, str] = ("", "")
        self._logged_at: float | None = None

    def note(self, peer: str, reason: str, detail: str = "") -> None:
        """Count one refused connection from ``peer`` (``reason`` groups it in the log line)."""
        with self._lock:
            self.total += 1
            self.counts[reason] += 1
            self._unlogged[reason] += 1
            self._last = (peer, f"{reason}: {detail}" if detail else reason)
            now = time.monotonic()
            if self._logged_at is not None and now - self._logged_at < self.interval:
                return
            message = self._take_summary(now)
        self._log.warning("%s", message)

    def describe(self) -> str:
        """All refusals so far in one phrase (for error messages); ``""`` when there were none."""
        with self._lock:
            if not self.total:
                return ""
            parts = ", ".join(f"{k}: {v}" for k, v in self.counts.most_common())
            peer, why = self._last
        return f"refused {self.total} connection(s) ({parts}; the last from {peer}: {why})"

    def flush(self) -> None:
        """Log what was refused since the last WARNING, if anything."""
        with self._lock:
            if not self._unlogged:
                return
            message = self._take_summary(time.monotonic())
        self._log.warning("%s", message)

    def _take_summary(self, now: float) -> str:
        n = sum(self._unlogged.values())
        parts = ", ".join(f"{k}: {v}" for k, v in self._unlogged.most_common())
        since = "" if self._logged_at is None else f" in the last {now - self._logged_at:.0f}s"
        self._unlogged.clear()
        self._logged_at = now
        peer, why = self._last
        return (
            f"{self.what} refused {n} connection(s){since} ({parts}); last from {peer} ({why}). "
            f"Further refusals are summed up at most every {self.interval:g}s."
        )
