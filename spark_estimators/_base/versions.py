"""Which pyspark this package runs on: 3.5 or later for classic sessions, 4.0 for Spark Connect.

Checked at the first call that touches a session (:func:`spark_estimators._base.session.get_spark`
and :func:`~spark_estimators._base.session.is_connect`), not at import: ``import
spark_estimators`` does not import pyspark, and rank processes never need it.

What is tested on 3.5 and why Connect needs 4.0 is in docs/concepts.md ("What is tested where"):
pyspark 3.5's wheel has no Spark Connect server (``remote("local")`` fails with
``ClassNotFoundException: org.apache.spark.sql.connect.SparkConnectPlugin``; the jar comes from
Maven), so the Connect paths were never run on 3.5.
"""

from __future__ import annotations

import functools
import re

from spark_estimators.errors import ConfigurationError

#: Oldest pyspark for a classic session (``mapInArrow(..., barrier=True)`` arrived in 3.5).
MIN_CLASSIC = (3, 5)
#: Oldest pyspark for a Spark Connect client.
MIN_CONNECT = (4, 0)


def parse_version(text: str) -> tuple[int, int]:
    """``"3.5.9"`` -> ``(3, 5)``; ``"4.1.0.dev1"`` -> ``(4, 1)``."""
    m = re.match(r"(\d+)\.(\d+)", text.strip())
    if m is None:
        raise ConfigurationError(f"cannot read the pyspark version {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_pyspark_version(version: str, connect: bool = False) -> None:
    """Raise :class:`ConfigurationError` naming the required pyspark when ``version`` is too old."""
    need = MIN_CONNECT if connect else MIN_CLASSIC
    if parse_version(version) >= need:
        return
    wanted = ".".join(map(str, need))
    if connect:
        raise ConfigurationError(
            f"a Spark Connect session needs pyspark>={wanted}, but this client has pyspark "
            f"{version}; use a classic session (pyspark>={'.'.join(map(str, MIN_CLASSIC))}) or "
            f"upgrade the client: pip install 'pyspark[connect]>={wanted},<4.4'"
        )
    raise ConfigurationError(
        f"spark_estimators needs pyspark>={wanted} (classic sessions; Spark Connect needs "
        f">={'.'.join(map(str, MIN_CONNECT))}), but this Python has pyspark {version}; "
        f"pip install 'pyspark>={wanted},<4.4' or use a runtime with Spark {wanted} or later"
    )


@functools.cache
def installed_pyspark() -> str:
    """The version of the pyspark this process imports."""
    import pyspark

    return str(pyspark.__version__)


def require_pyspark(connect: bool = False) -> None:
    """:func:`check_pyspark_version` for the installed pyspark."""
    check_pyspark_version(installed_pyspark(), connect=connect)
