"""Run in its own process: two run() jobs at once in one local[4] SparkSession, several rounds.

Each round starts both jobs together (a threading.Barrier, no sleeps); each job has 2 ranks that
join a gloo group on their own rendezvous port and allreduce. Prints ``RESULT <json>``: per round
and job the ranks, the sums and the port, and any error. Before the rendezvous port was held,
the two jobs could end up on one port (gloo's join: "Connection reset by peer").
"""

import json
import os
import sys
import threading

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import spark_estimators  # noqa: E402
from spark_estimators.core.session import create_local_session  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4


def allreduce_rank():
    import os

    import numpy as np

    import spark_estimators.collective as hvd

    hvd.init()
    try:
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
        return {"rank": hvd.rank(), "sum": float(total[0]), "port": int(os.environ["MASTER_PORT"])}
    finally:
        hvd.shutdown()


def main():
    spark = create_local_session("local[4]", spark__task__maxFailures="1")
    out = {"rounds": [], "errors": []}
    try:
        for _ in range(ROUNDS):
            start = threading.Barrier(2)
            results = {}

            def job(name, start=start, results=results):
                start.wait()
                try:
                    results[name] = spark_estimators.run(
                        allreduce_rank, num_proc=2, spark=spark, backend="gloo"
                    )
                except Exception as exc:  # recorded, the test shows it
                    out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=job, args=(n,)) for n in ("a", "b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out["rounds"].append(results)
    finally:
        spark.stop()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
