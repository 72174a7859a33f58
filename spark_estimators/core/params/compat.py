"""horovod.spark compatibility of the estimators' keywords: aliases, refusals, defaults-only.

A horovod keyword either maps to a Param (through :data:`~spark_estimators.core.params.base.
ALIASES`), or it is refused in the driver with a :class:`~spark_estimators.errors.
ConfigurationError` that names the alternative, never accepted and ignored:

- :data:`UNSUPPORTED`: Params kept for horovod parity that accept only their "not used" default
  (checked by :func:`check_unsupported` before a fit);
- :attr:`KeywordParams._horovod_only`: horovod keywords of an estimator with no Param here
  (refused when set to anything but their "not used" value);
- :attr:`KeywordParams._not_taken`: keywords other estimators take but this one does not
  (``loss=`` on the Lightning estimator: the module computes it), refused the same way.
"""

from __future__ import annotations

import difflib
from typing import ClassVar, Self

from pyspark.ml.param import Params

from spark_estimators.core.params.base import to_camel, to_snake
from spark_estimators.errors import ConfigurationError

# horovod's data-module keywords (TorchEstimator, KerasEstimator): the reader here is built in.
HOROVOD_DATA_MODULE_KEYWORDS: dict[str, tuple[tuple[object, ...], str]] = {
    "data_module": (
        (None,),
        "batches come from the built-in reader over the prepared data; shape them with "
        "transformation_fn, input_shapes and label_shapes, or remove data_module",
    ),
    "continuous_cols": (
        (None, []),
        "list the columns in feature_cols (each column is one model input), or remove it",
    ),
    "categorical_cols": (
        (None, []),
        "list the columns in feature_cols as integer indices (StringIndexer) for embeddings "
        "(each column is one model input), or remove it",
    ),
}


def _unused(value: object, accepted: tuple[object, ...]) -> bool:
    return any(value is a or (a is not None and value == a) for a in accepted)


class KeywordParams(Params):
    """``setParams(**kwargs)`` by camelCase Param names or horovod's snake_case keywords."""

    # horovod keywords of this estimator with no Param here: name -> (values accepted because
    # they mean "not used", the alternative named in the error for any other value).
    _horovod_only: ClassVar[dict[str, tuple[tuple[object, ...], str]]] = {}
    # keywords of other estimators this one does not take: name -> (values accepted because
    # they mean "not used", why and what to do instead).
    _not_taken: ClassVar[dict[str, tuple[tuple[object, ...], str]]] = {}

    def setParams(self, **kwargs: object) -> Self:
        """Set params by Spark ML (camelCase) or horovod (snake_case) names; returns self."""
        for key, value in kwargs.items():
            name = to_camel(key)
            if not self.hasParam(name):
                self._refuse_keyword(key, value)
                continue
            self._set(**{name: value})
        return self

    def _refuse_keyword(self, key: str, value: object) -> None:
        """Accept a keyword without a Param at its "not used" value; else raise, naming why."""
        cls = type(self).__name__
        snake = to_snake(key)
        entry = self._horovod_only.get(snake) or self._not_taken.get(snake)
        if entry is not None:
            unused, why = entry
            if _unused(value, unused):
                return
            if snake in self._horovod_only:
                raise ConfigurationError(
                    f"{cls}: horovod's {snake}={value!r} has no equivalent here; {why}"
                )
            raise ConfigurationError(
                f"{snake}= (a {type(value).__name__}) is not used by {cls}: {why}"
            )
        known = sorted({p.name for p in self.params} | {to_snake(p.name) for p in self.params})
        close = difflib.get_close_matches(key, known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigurationError(f"{cls} got an unknown keyword {key!r}.{hint}")


# Horovod parameters with no equivalent here: a value other than the default is refused with the
# alternative (they were accepted and silently ignored before).
UNSUPPORTED: dict[str, tuple[str, tuple[object, ...], str]] = {
    "readerPoolType": (
        "reader_pool_type",
        ("thread", None),
        "the default reader decodes with pyarrow's threads, not a petastorm pool; use "
        "train_reader_num_workers / val_reader_num_workers to set its parallelism, or "
        "reader='petastorm' for petastorm's 'thread' / 'process' pool",
    ),
    "mpStartMethod": (
        "mp_start_method",
        (None,),
        "no multiprocessing pool is used: each rank is a fresh process started by its Spark "
        "task and the reader uses threads; remove mp_start_method",
    ),
    "transformationEditFields": (
        "transformation_edit_fields",
        (None,),
        "with the default reader transformation_fn returns a pandas DataFrame whose columns may "
        "be added or removed freely (no petastorm TransformSpec schema to edit); remove it, or "
        "pass reader='petastorm'",
    ),
    "transformationRemovedFields": (
        "transformation_removed_fields",
        (None,),
        "with the default reader transformation_fn may drop columns itself (no petastorm "
        "TransformSpec schema to edit); remove it, or pass reader='petastorm'",
    ),
}


# The horovod settings that belong to petastorm: taken as horovod documents them with
# reader='petastorm' (data/petastorm_reader.py), refused above with the default reader.
PETASTORM_PARAMS = ("readerPoolType", "transformationEditFields", "transformationRemovedFields")
PETASTORM_POOL_TYPES = ("thread", "process", "dummy")


def check_unsupported(est: Params) -> None:
    """Refuse horovod parameters that have no effect here, naming what to use instead."""
    table = dict(UNSUPPORTED)
    table.update(getattr(est, "_unsupported", {}))
    petastorm = est.hasParam("reader") and est.getOrDefault("reader") == "petastorm"
    if petastorm and est.hasParam("readerPoolType"):
        pool = est.getOrDefault("readerPoolType")
        if pool not in (*PETASTORM_POOL_TYPES, None):
            raise ConfigurationError(
                f"reader_pool_type={pool!r} is invalid: expected one of {PETASTORM_POOL_TYPES!r}"
            )
    for name, (keyword, allowed, why) in table.items():
        if not est.hasParam(name) or (petastorm and name in PETASTORM_PARAMS):
            continue
        value = est.getOrDefault(name)
        if not _unused(value, allowed):
            raise ConfigurationError(f"{keyword}={value!r} is not supported: {why}")
    size = est.getOrDefault("shuffleBufferSize") if est.hasParam("shuffleBufferSize") else None
    if size is not None and (isinstance(size, bool) or size < 0):
        raise ConfigurationError(
            f"shuffle_buffer_size={size!r} is invalid: expected None (automatic), 0 (no "
            "shuffling) or a positive number of rows"
        )
