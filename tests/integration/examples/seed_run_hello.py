"""The seed's ``horovod.spark.run`` toy example (Horovod on Spark > Horovod Spark Run), ported.

Seed: 003_*.txt, "Horovod Spark Run": ``fn(magic_number)`` prints its ranks and returns
``hvd.rank()``; ``horovod.spark.run(fn, args=(42,))`` returns the ranks in order.

Changed lines:

- ``import horovod.torch as hvd`` -> ``import spark_estimators.collective.torch as hvd``
- ``import horovod.spark`` -> ``import spark_estimators``
- ``horovod.spark.run(fn, args=(42,))`` -> ``spark_estimators.run(fn, args=(42,))`` (the module's
  name, as imported)

The seed types it into the ``pyspark`` shell, which makes the session; a script makes it
itself (``create_local_session()``: local[2], so ``num_proc`` defaults to 2 ranks where the
seed's cluster had 16). Prints the ranks' lines, then ``RESULT <json list>``.
"""

import json


def fn(magic_number):
    import spark_estimators.collective.torch as hvd  # was: import horovod.torch as hvd

    hvd.init()
    print(
        "Hello, rank = %d, local_rank = %d, size = %d, local_size = %d, magic_number = %d"  # noqa: UP031
        % (hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), magic_number)
    )
    return hvd.rank()


if __name__ == "__main__":
    from spark_estimators.core.session import create_local_session

    spark = create_local_session()  # the pyspark shell's session

    import spark_estimators  # was: import horovod.spark

    result = spark_estimators.run(fn, args=(42,))  # was: horovod.spark.run(fn, args=(42,))
    print("RESULT " + json.dumps(result))
    spark.stop()
