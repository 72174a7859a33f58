"""A driver that lives all day: what each job starts in the driver process ends with it (issue 40).

Each ``run()`` starts a driver service (an RPC server: a listening socket, an accept thread, one
thread per connection), for ``backend="mpi"`` a PMI server, and a thread that runs the Spark job.
``RpcServer.close()`` used to leave its accept thread blocked in ``accept()``, holding the socket
and its port: 50 ``run()`` calls took the driver from 11 to 61 threads.

The bounds, against a baseline taken after one warm-up job (which starts Spark's Python workers
and their zygotes, reused afterwards):

* threads <= baseline + 2, open fds <= baseline + 5, listening TCP sockets <= baseline
  (the slack covers a py4j callback thread or connection that Spark opens on its own);
* the soak (``-m slow``, or ``make soak``): 200 ``run()`` calls and 50 ``TorchEstimator`` fits in
  one driver, the same bounds plus child processes <= baseline + 2 (a Python worker Spark
  starts or lets go) and RSS growth <= 16 MB over the second half of the jobs (the first half
  warms caches: Spark's plan caches, torch's and cloudpickle's).
"""

from __future__ import annotations

import dataclasses
import time

import psutil
import pytest

import spark_estimators

pytestmark = [pytest.mark.spark, pytest.mark.multiprocess]

THREAD_SLACK = 2
FD_SLACK = 5
CHILD_SLACK = 2
RSS_GROWTH_MB = 16.0


@dataclasses.dataclass(frozen=True)
class DriverResources:
    """What the driver process holds at one moment."""

    threads: int
    fds: int
    listening: int
    children: int
    rss_mb: float

    @classmethod
    def now(cls) -> DriverResources:
        proc = psutil.Process()
        conns = proc.net_connections("tcp")
        children = [p for p in proc.children(recursive=True) if _status(p) not in (None, "zombie")]
        return cls(
            threads=proc.num_threads(),
            fds=proc.num_fds(),
            listening=sum(c.status == psutil.CONN_LISTEN for c in conns),
            children=len(children),
            rss_mb=proc.memory_info().rss / 2**20,
        )

    def over(self, base: DriverResources, children: bool = False) -> list[str]:
        """The bounds this snapshot breaks, compared with ``base``."""
        bad = []
        if self.threads > base.threads + THREAD_SLACK:
            bad.append(f"threads {base.threads} -> {self.threads} (bound +{THREAD_SLACK})")
        if self.fds > base.fds + FD_SLACK:
            bad.append(f"open fds {base.fds} -> {self.fds} (bound +{FD_SLACK})")
        if self.listening > base.listening:
            bad.append(f"listening sockets {base.listening} -> {self.listening} (bound +0)")
        if children and self.children > base.children + CHILD_SLACK:
            bad.append(f"child processes {base.children} -> {self.children} (+{CHILD_SLACK})")
        return bad


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.Error:
        return None


def _echo(value):
    return value


def settled(base: DriverResources, children: bool = False, wait_s: float = 10.0) -> list[str]:
    """The bounds still broken once the last job's threads had ``wait_s`` seconds to end.

    (A job's Spark thread ends a moment after ``run()`` returns; a leak never does.)
    """
    deadline = time.monotonic() + wait_s
    while True:
        bad = DriverResources.now().over(base, children)
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_run_calls_leave_no_threads_fds_or_listening_sockets(spark):
    assert spark_estimators.run(_echo, args=("warm",), num_proc=2, verbose=0) == ["warm"] * 2
    base = DriverResources.now()
    for i in range(8):
        assert spark_estimators.run(_echo, args=(i,), num_proc=2, verbose=0) == [i, i]
    assert settled(base) == []


def _soak_df(spark):
    from pyspark.ml.linalg import Vectors

    rows = [(Vectors.dense([float(i % 7), float(i % 3)]), float(i % 5)) for i in range(64)]
    return spark.createDataFrame(rows, ["features", "y"]).cache()


def _fit(df, store, i):
    import torch

    from spark_estimators.torch import TorchEstimator

    torch.manual_seed(i)
    model = torch.nn.Linear(2, 1)
    est = TorchEstimator(
        num_proc=2, store=store, model=model, loss=torch.nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01), feature_cols=["features"],
        label_cols=["y"], batch_size=32, epochs=1, verbose=0, run_id=f"soak{i}",
    )  # fmt: skip
    fitted = est.fit(df)
    assert len(fitted.getHistory()) == 1
    store.delete_run(f"soak{i}")  # the store's growth is not what this soak measures


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_200_runs_and_50_fits_in_one_driver(spark, tmp_path):
    """200 ``run()`` and 50 fits: threads, fds, sockets, children and RSS stay flat."""
    pytest.importorskip("torch")
    from spark_estimators.store import LocalStore

    store = LocalStore(str(tmp_path / "store"))
    df = _soak_df(spark)
    spark_estimators.run(_echo, args=(0,), num_proc=2, verbose=0)
    _fit(df, store, -1)
    base = DriverResources.now()
    jobs: list[tuple[str, int]] = [("run", i) for i in range(200)]
    for k in range(50):  # a fit after every 4 runs
        jobs.insert(5 * k + 4, ("fit", k))
    samples = []
    started = time.monotonic()
    for n, (kind, i) in enumerate(jobs, 1):
        if kind == "run":
            assert spark_estimators.run(_echo, args=(i,), num_proc=2, verbose=0) == [i, i]
        else:
            _fit(df, store, i)
        if n % 25 == 0 or n == len(jobs) // 2:
            samples.append((n, DriverResources.now()))
    bad = settled(base, children=True)
    end = DriverResources.now()
    half = next(r for n, r in samples if n == len(jobs) // 2)
    print(f"\nsoak: {len(jobs)} jobs in {time.monotonic() - started:.0f}s; baseline {base}")
    for n, r in samples:
        print(f"  after {n:3d} jobs: {r}")
    print(f"  end: {end}; RSS growth over the second half {end.rss_mb - half.rss_mb:+.1f} MB")
    assert bad == []
    assert end.rss_mb - half.rss_mb <= RSS_GROWTH_MB, (half, end)
