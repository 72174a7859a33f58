"""The framework adapters' import check: a missing framework names the pip extra to install.

``spark_estimators.collective.tensorflow`` and ``spark_estimators.collective.keras`` import their
framework under :func:`requires_extra`, so that ``import spark_estimators.collective.keras`` without
TensorFlow says what to install instead of only ``No module named 'tensorflow'``. This module
imports no framework itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def requires_extra(needed_by: str, frameworks: str, extra: str) -> Iterator[None]:
    """Turn an ``ImportError`` raised in the block into one naming the extra to install.

    Parameters
    ----------
    needed_by
        What imports the frameworks (a module name, as the user imported it).
    frameworks
        What it needs, in words (``"TensorFlow and Keras 3"``).
    extra
        The ``spark-estimators`` extra that installs them (``"keras"``).

    Raises
    ------
    ImportError
        ``"<needed_by> needs <frameworks>: pip install 'spark-estimators[<extra>]'"``, chained
        to the original error.

    Examples
    --------
    >>> with requires_extra("my_adapter", "NumPy", "numpy"):
    ...     import numpy
    """
    try:
        yield
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs {frameworks}: pip install 'spark-estimators[{extra}]'"
        ) from exc
