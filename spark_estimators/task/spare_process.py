"""Entry point of a worker's zygote: ``python -m spark_estimators.task.spare_process``.

See :mod:`spark_estimators.task.spare` (kept apart so that ``-m`` does not run a module that
the package has already imported).
"""

from spark_estimators.task.spare import main

if __name__ == "__main__":
    main()
