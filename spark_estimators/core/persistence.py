"""Spark ML persistence for our Python-only stages (estimators and models).

A saved stage is a directory with Spark's standard ``metadata/`` (written by
``DefaultParamsWriter``, so ``Pipeline`` / ``PipelineModel`` can find the class) holding the
JSON-able params, plus ``stage.pkl``: a cloudpickle of the params that hold Python objects
(model, optimizer, loss, callbacks, ...) and of the stage's extra state (a fitted model's
weights, history, run id). The ``store`` and ``backend`` params are never saved: they hold
credentials, sessions and clients; set them again after loading an estimator.
"""

from __future__ import annotations

import json
from typing import Any

import cloudpickle
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

NOT_SAVED = ("store", "backend")
BLOB_NAME = "stage.pkl"


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _open(path: str, mode: str) -> Any:
    import fsspec

    return fsspec.open(path, mode)


class StageWriter(MLWriter):
    """Writes a stage; the stage may define ``_extra_state() -> dict`` for non-param state."""

    def __init__(self, instance: Any):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        inst = self.instance
        json_params: dict[str, Any] = {}
        blob_params: dict[str, Any] = {}
        for param, value in inst._paramMap.items():
            if param.name in NOT_SAVED:
                continue
            if _is_json(value):
                json_params[param.name] = value
            else:
                blob_params[param.name] = value
        # The session (not self.sc): a Spark Connect client has no SparkContext.
        DefaultParamsWriter.saveMetadata(inst, path, self.sparkSession, paramMap=json_params)
        extra = inst._extra_state() if hasattr(inst, "_extra_state") else {}
        with _open(path.rstrip("/") + "/" + BLOB_NAME, "wb") as f:
            f.write(cloudpickle.dumps({"params": blob_params, "extra": extra}))


class StageReader(MLReader):
    """Reads a stage written by :class:`StageWriter` back into ``cls``."""

    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        with _open(path.rstrip("/") + "/" + BLOB_NAME, "rb") as f:
            blob = cloudpickle.loads(f.read())
        for name, value in blob["params"].items():
            instance._set(**{name: value})
        if hasattr(instance, "_restore_extra_state"):
            instance._restore_extra_state(blob["extra"])
        return instance


class PersistenceMixin(MLWritable, MLReadable):
    """``write()`` / ``read()`` / ``save()`` / ``load()`` for our stages."""

    def write(self) -> MLWriter:
        return StageWriter(self)

    def save(self, path: str) -> None:
        self.write().save(path)

    @classmethod
    def read(cls) -> MLReader:
        return StageReader(cls)

    @classmethod
    def load(cls, path: str) -> Any:
        return cls.read().load(path)
