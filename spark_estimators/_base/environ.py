"""Checking the ``env=`` a user passes for the rank processes, before any Spark job."""

from __future__ import annotations

from typing import Any

from spark_estimators.errors import ConfigurationError


def validate_env(env: dict[str, Any] | None) -> dict[str, str]:
    """Return ``env`` as a new dict of str to str (``{}`` for None); raise naming bad keys."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ConfigurationError(f"env must be a dict of str to str, got {type(env).__name__}")
    bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ConfigurationError(
            f"env must map str to str; these keys do not: {bad[:5]!r} (convert values with str())"
        )
    return dict(env)
