"""pyspark floors: 3.5 for classic sessions, 4.0 for Spark Connect, with errors that say so.

The last test builds a Connect client session without a server (nothing is sent before the
first query) and runs only where the installed pyspark is older than 4.0, as in
``make test-spark35``: there ``run()`` must refuse it with the version, before any job.
"""

from __future__ import annotations

import pytest

from spark_estimators._base.versions import check_pyspark_version, installed_pyspark
from spark_estimators.errors import ConfigurationError


@pytest.mark.parametrize("version", ["3.5.0", "3.5.9", "4.0.0", "4.3.0", "4.1.0.dev1"])
def test_classic_accepts_3_5_and_later(version):
    check_pyspark_version(version)


@pytest.mark.parametrize("version", ["3.4.3", "3.3.0", "2.4.8"])
def test_classic_refuses_older_naming_the_floor_and_the_version(version):
    with pytest.raises(ConfigurationError, match=rf"pyspark>=3\.5 .*has pyspark {version}"):
        check_pyspark_version(version)


@pytest.mark.parametrize("version", ["3.5.0", "3.5.9"])
def test_connect_refuses_3_5_naming_4_0(version):
    with pytest.raises(
        ConfigurationError, match=rf"Connect session needs pyspark>=4\.0.*{version}"
    ):
        check_pyspark_version(version, connect=True)


@pytest.mark.parametrize("version", ["4.0.0", "4.3.0"])
def test_connect_accepts_4(version):
    check_pyspark_version(version, connect=True)


def test_unreadable_version_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="cannot read the pyspark version 'abc'"):
        check_pyspark_version("abc")


@pytest.mark.skipif(
    not installed_pyspark().startswith("3."), reason="a Connect session is refused on pyspark 3.x"
)
def test_run_refuses_a_connect_session_on_pyspark_3_before_any_job():
    pytest.importorskip("grpc")
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    import spark_estimators

    session = ConnectSession(connection="sc://127.0.0.1:9")  # no server: nothing is sent
    calls = []
    with pytest.raises(ConfigurationError, match=r"Connect session needs pyspark>=4\.0"):
        spark_estimators.run(calls.append, args=(1,), num_proc=1, spark=session)
    assert calls == []
