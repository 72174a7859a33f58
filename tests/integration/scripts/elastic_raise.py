"""Run in its own process: run_elastic on a local[2,2] session where every rank raises.

Every attempt raises the same ValueError, so Spark's retries run out and the job fails. Prints
``RESULT <json>`` with the error's type and text.
"""

import json
import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from spark_estimators.core.session import create_local_session  # noqa: E402
from spark_estimators.elastic import run_elastic  # noqa: E402
from spark_estimators.errors import TrainingFailedError  # noqa: E402


def train(rate):
    raise ValueError(f"learning rate {rate} is out of range; try 0.01")


def main() -> None:
    spark = create_local_session("local[2,2]")
    spark.sparkContext.setLogLevel("OFF")
    try:
        run_elastic(train, args=(7.5,), num_proc=2, rejoin_wait=2.0, spark=spark, verbose=0)
        result = {"error": None}
    except TrainingFailedError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
