"""Spark ML persistence for our Python-only stages (estimators and models).

A saved stage is a directory with Spark's standard ``metadata/`` (written by
``DefaultParamsWriter``, so ``Pipeline`` / ``PipelineModel`` can find the class) holding the
JSON-able params, plus ``stage.pkl``: a cloudpickle of the params that hold Python objects
(model, optimizer, loss, callbacks, ...) and of the stage's extra state (a fitted model's
weights, history, run id). The ``store`` and ``backend`` params are never saved: they hold
credentials, sessions and clients; set them again after loading an estimator.

Trust boundary (docs/security.md, "Saved models and checkpoints"): unpickling ``stage.pkl`` runs
whatever code it names, so it is verified **before** it is unpickled. At save the metadata
records ``stageDigest``: the SHA-256 of ``stage.pkl`` and, when a key is given (``key=`` or the
environment variable ``SPARK_ESTIMATORS_MODEL_KEY``), its HMAC-SHA256 under that key. At load a
mismatch raises :class:`~spark_estimators.errors.ModelIntegrityError` and nothing is unpickled.
The plain digest catches corruption and a replaced ``stage.pkl``; only the HMAC, with a key kept
outside the storage, also stops someone who can rewrite the metadata. Decisions:

- a stage saved before digests were recorded (no ``stageDigest``) loads with an
  :class:`~spark_estimators.errors.UnverifiedModelWarning`, unless a key is configured: then it is
  refused, as is any stage without an HMAC (stripping the HMAC must not bypass the key);
- a signed stage loaded without a key is checked against its SHA-256 only, with a warning;
- an unsigned stage loaded without a key is checked against its SHA-256, with a
  :class:`~spark_estimators.errors.NoModelKeyWarning`: without a key nothing can tell it from a
  signed stage whose signature was stripped and digest rewritten (issue 40), since whoever can
  rewrite the metadata can remove any record that it was signed. A key at load refuses that case;
- with a key, the HMAC also covers the metadata that rebuilds the stage (``class``, ``uid``,
  ``paramMap``, ``defaultParamMap``: featureCols, labelCols, ...), recorded as
  ``metadataHmacSha256``; an edited metadata is refused. A stage signed by an earlier version
  (HMAC of ``stage.pkl`` only) still loads with the key, its ``stage.pkl`` verified, with an
  :class:`~spark_estimators.errors.UnverifiedModelWarning` that its metadata is not covered.

``write().overwrite().save(path)`` removes an existing ``path`` itself, through the same
filesystem layer (fsspec) that writes ``stage.pkl``, instead of pyspark's
``MLWriter._handleOverwrite``, which calls into the JVM session and so fails on a Spark Connect
client (issue 25). It refuses to remove a filesystem root or the working directory (or one of
its parents).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar, cast

import cloudpickle
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from spark_estimators import envvars
from spark_estimators._base.versions import installed_pyspark, parse_version
from spark_estimators.errors import (
    ConfigurationError,
    ModelIntegrityError,
    NoModelKeyWarning,
    UnverifiedModelWarning,
)

if TYPE_CHECKING:
    from fsspec.core import OpenFile
    from pyspark import SparkContext
    from pyspark.ml.param import Params
    from pyspark.sql import SparkSession

NOT_SAVED = ("store", "backend")
BLOB_NAME = "stage.pkl"
#: Key of the integrity record in the stage's Spark metadata (``metadata/part-00000``).
DIGEST_KEY = "stageDigest"
#: The metadata fields the metadata HMAC covers: what rebuilds the stage at load.
SIGNED_METADATA = ("class", "uid", "paramMap", "defaultParamMap")
_METADATA_DOMAIN = b"spark_estimators stage metadata v1\0"


def _is_json(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _open(path: str, mode: str) -> OpenFile:
    import fsspec

    return fsspec.open(path, mode)


def model_key(key: str | bytes | None = None) -> bytes | None:
    """The signing key: ``key`` when given, else ``$SPARK_ESTIMATORS_MODEL_KEY``, else None."""
    if key is None:
        key = os.environ.get(envvars.MODEL_KEY) or None
    if key is None:
        return None
    return key.encode() if isinstance(key, str) else bytes(key)


def integrity_record(blob: bytes, key: bytes | None) -> dict[str, str]:
    """What the metadata records about ``stage.pkl``: its SHA-256 and, with a key, its HMAC."""
    record = {"file": BLOB_NAME, "sha256": hashlib.sha256(blob).hexdigest()}
    if key is not None:
        record["hmacSha256"] = hmac.new(key, blob, hashlib.sha256).hexdigest()
    return record


def metadata_mac(key: bytes, blob_sha256: str, metadata: Mapping[str, object]) -> str:
    """HMAC-SHA256 of the stage's :data:`SIGNED_METADATA` fields (canonical JSON) and digest."""
    fields = {name: metadata.get(name) for name in SIGNED_METADATA}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True)
    message = _METADATA_DOMAIN + blob_sha256.encode() + b"\0" + canonical.encode("utf-8")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def saved_metadata(instance: Params, json_params: Mapping[str, object]) -> dict[str, object]:
    """The :data:`SIGNED_METADATA` fields as Spark's ``DefaultParamsWriter`` writes them."""
    fields = {
        "class": type(instance).__module__ + "." + type(instance).__name__,
        "uid": instance.uid,
        "paramMap": json_params,
        "defaultParamMap": {p.name: v for p, v in instance._defaultParamMap.items()},
    }
    return dict(json.loads(json.dumps(fields)))  # as read back: tuples are lists, and so on


def verify_metadata(path: str, metadata: dict[str, Any], key: bytes | None) -> None:
    """With a key, check the metadata HMAC of a stage whose ``stage.pkl`` verified.

    Raises
    ------
    ModelIntegrityError
        The metadata was changed after the stage was signed.
    """
    record = metadata.get(DIGEST_KEY)
    if key is None or not isinstance(record, dict) or "sha256" not in record:
        return  # nothing signed, or no key: verify_blob already decided
    signature = record.get("metadataHmacSha256")
    if signature is None:
        warnings.warn(
            f"{path!r} was signed by an earlier spark_estimators: the HMAC covers its "
            "stage.pkl (verified) but not its metadata (featureCols, labelCols and the other "
            "params), which loads unverified. Save it again to sign the metadata too.",
            UnverifiedModelWarning,
            stacklevel=4,
        )
        return
    expected = metadata_mac(key, str(record["sha256"]), metadata)
    if not hmac.compare_digest(expected, str(signature)):
        raise ModelIntegrityError(
            f"refused to load {path!r}: its metadata (class, uid or params such as featureCols "
            "and labelCols) does not match its HMAC under the configured model key; it was "
            "changed after the model was signed. Load only models you saved yourself or got "
            "from a source you trust; if this one is yours, save it again from the fitted model.",
            path=path,
            expected=str(signature),
            found=expected,
        )


def verify_blob(path: str, blob: bytes, record: Any, key: bytes | None) -> None:
    """Check ``blob`` (read from ``path``) against its recorded digest before it is unpickled.

    Raises
    ------
    ModelIntegrityError
        The digest or HMAC does not match, or a key is configured and the stage has no HMAC.
    """
    fix = (
        "Load only models you saved yourself or got from a source you trust; if this one is "
        "yours, save it again from the fitted model."
    )
    if not isinstance(record, dict) or "sha256" not in record:
        if key is not None:
            raise ModelIntegrityError(
                f"refused to load {path!r}: a model key is configured ({envvars.MODEL_KEY} or "
                "key=) but this stage was saved without a signature, so it cannot be verified. "
                "Save it again with the key, or load it without a key if you trust its source.",
                path=path,
            )
        warnings.warn(
            f"{path!r} has no integrity record (saved before spark_estimators recorded one); "
            "it is unpickled unverified, which runs any code it holds. Save it again to record "
            "its digest.",
            UnverifiedModelWarning,
            stacklevel=4,
        )
        return
    found = hashlib.sha256(blob).hexdigest()
    if not hmac.compare_digest(found, str(record["sha256"])):
        raise ModelIntegrityError(
            f"refused to load {path!r}: its SHA-256 is {found} but the model's metadata "
            f"recorded {record['sha256']}; the file was changed or corrupted after it was saved "
            f"and was not unpickled. {fix}",
            path=path,
            expected=str(record["sha256"]),
            found=found,
        )
    signature = record.get("hmacSha256")
    if key is None:
        if signature is None:
            warnings.warn(
                f"{path!r} is loaded without a model key ({envvars.MODEL_KEY} or key=): its "
                "SHA-256 matched, which catches corruption but not someone who can write the "
                "model's directory (a model signed with a key whose signature was removed and "
                "digest rewritten looks exactly like this one). Set the key your models are "
                "signed with to check who wrote it; if you do not sign models, silence this with "
                "warnings.filterwarnings('ignore', category=NoModelKeyWarning).",
                NoModelKeyWarning,
                stacklevel=4,
            )
        else:
            warnings.warn(
                f"{path!r} is signed but no key is set ({envvars.MODEL_KEY} or key=): only its "
                "SHA-256 was checked, which does not stop someone who can also rewrite the "
                "metadata.",
                UnverifiedModelWarning,
                stacklevel=4,
            )
        return
    expected = hmac.new(key, blob, hashlib.sha256).hexdigest()
    if signature is None or not hmac.compare_digest(expected, str(signature)):
        what = "carries no HMAC" if signature is None else "has an HMAC that does not match"
        raise ModelIntegrityError(
            f"refused to load {path!r}: it {what} under the configured model key "
            f"({envvars.MODEL_KEY} or key=); it was not signed with this key or was altered, "
            f"and was not unpickled. {fix}",
            path=path,
            expected=None if signature is None else str(signature),
            found=expected,
        )


def _metadata_context(io: MLWriter | MLReader) -> SparkSession | SparkContext:
    """What Spark ML's metadata helpers take: the session, or on pyspark 3.5 the SparkContext.

    pyspark 4 takes the session (a Spark Connect client has no SparkContext); 3.5's helpers call
    ``sc.parallelize`` and accept only a SparkContext (3.5 Connect sessions are refused earlier).
    """
    if parse_version(installed_pyspark()) >= (4, 0):
        return io.sparkSession
    return io.sparkSession.sparkContext


def remove_for_overwrite(path: str) -> None:
    """Delete ``path`` (a saved stage's directory) before it is written again, if it exists.

    Raises
    ------
    ConfigurationError
        ``path`` is a filesystem root, or the working directory or one of its parents.
    """
    import fsspec

    fs, target = fsspec.core.url_to_fs(path)
    stripped = str(target).rstrip("/")
    is_local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if is_local:
        stripped = os.path.abspath(stripped or "/")
        cwd = os.path.abspath(os.getcwd())
        dangerous = stripped == "/" or cwd == stripped or cwd.startswith(stripped + os.sep)
    else:
        dangerous = "/" not in stripped.strip("/")  # a bucket or filesystem root
    if dangerous:
        raise ConfigurationError(
            f"refusing to overwrite {path!r}: it is a filesystem root or holds the working "
            "directory; save the stage into a directory of its own, e.g. "
            f"{path.rstrip('/') + '/my_model'!r}"
        )
    if fs.exists(target):
        fs.rm(target, recursive=True)


S = TypeVar("S")


class _StageIO(Generic[S]):
    """What a :class:`StageWriter` / :class:`StageReader` is made with.

    ``stage``: the stage to write, or the class to read a stage into; ``key``: the HMAC key the
    writer signs with and the reader checks (None: ``$SPARK_ESTIMATORS_MODEL_KEY`` if set).
    """

    def __init__(self, stage: S, key: str | bytes | None = None) -> None:
        super().__init__()
        self.stage = stage
        self._key = key


class StageWriter(_StageIO["Params"], MLWriter):
    """Writes a stage; the stage may define ``_extra_state() -> dict`` for non-param state."""

    def _handleOverwrite(self, path: str) -> None:
        """``overwrite()``: remove ``path`` through fsspec (pyspark's way needs a JVM session)."""
        remove_for_overwrite(path)

    def saveImpl(self, path: str) -> None:
        """Write the JSON metadata and ``stage.pkl`` (other params, the model) with its digest."""
        inst = self.stage
        json_params: dict[str, object] = {}
        blob_params: dict[str, object] = {}
        for param, value in inst._paramMap.items():
            if param.name in NOT_SAVED:
                continue
            if _is_json(value):
                json_params[param.name] = value
            else:
                blob_params[param.name] = value
        extra = inst._extra_state() if hasattr(inst, "_extra_state") else {}
        blob = cloudpickle.dumps({"params": blob_params, "extra": extra})
        key = model_key(self._key)
        record: dict[str, str] = integrity_record(blob, key)
        if key is not None:
            signed = saved_metadata(inst, json_params)
            record["metadataHmacSha256"] = metadata_mac(key, record["sha256"], signed)
        DefaultParamsWriter.saveMetadata(
            inst,
            path,
            _metadata_context(self),
            extraMetadata={DIGEST_KEY: record},
            paramMap=json_params,
        )
        with _open(path.rstrip("/") + "/" + BLOB_NAME, "wb") as f:
            f.write(blob)


class StageReader(_StageIO[type], MLReader):
    """Reads a stage written by :class:`StageWriter` back into a ``stage`` class, verified first."""

    def load(self, path: str) -> Params:
        """Verify ``stage.pkl`` against its digest (and HMAC with a key), then rebuild the stage."""
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_context(self))
        blob_path = path.rstrip("/") + "/" + BLOB_NAME
        with _open(blob_path, "rb") as f:
            data = f.read()
        key = model_key(self._key)
        verify_blob(blob_path, data, metadata.get(DIGEST_KEY), key)
        verify_metadata(path, metadata, key)
        instance = self.stage()
        instance._resetUid(metadata["uid"])
        blob = cloudpickle.loads(data)
        _drop_params_gone(instance, metadata, blob["params"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        for name, value in blob["params"].items():
            instance._set(**{name: value})
        if hasattr(instance, "_restore_extra_state"):
            instance._restore_extra_state(blob["extra"])
        return instance


def _drop_params_gone(
    instance: Params, metadata: dict[str, Any], blob_params: dict[str, object]
) -> None:
    """Remove Params the class no longer has from a saved stage's maps, before they are set.

    A stage saved by an older version may hold Params its class has since lost (the Lightning
    estimator's ``loss``, ``optimizer``, ... in issue 19). The class decides in
    ``_dropped_param(name, value)``: drop a value that meant "not used", refuse any other. A
    class without that hook keeps pyspark's behaviour (an error naming the missing Param).
    """
    hook = getattr(instance, "_dropped_param", None)
    if hook is None:
        return
    for params in (metadata.get("paramMap", {}), metadata.get("defaultParamMap", {}), blob_params):
        for name in [n for n in params if not instance.hasParam(n)]:
            hook(name, params.pop(name))


class PersistenceMixin(MLWritable, MLReadable):
    """``write()`` / ``read()`` / ``save()`` / ``load()`` for our stages.

    ``save(path, key=...)`` signs the stage with an HMAC under ``key`` and ``load(path,
    key=...)`` requires a matching one; without ``key`` both use ``$SPARK_ESTIMATORS_MODEL_KEY``
    when set (the way to sign stages inside a ``Pipeline``).
    """

    def write(self) -> MLWriter:
        """A writer of this stage (``.write().overwrite().save(path)``)."""
        return StageWriter(cast("Params", self))  # mixed into Params classes only

    def save(self, path: str, key: str | bytes | None = None) -> None:
        """Save to ``path``; ``key`` (or ``SPARK_ESTIMATORS_MODEL_KEY``) signs it with an HMAC."""
        StageWriter(cast("Params", self), key=key).save(path)

    @classmethod
    def read(cls) -> MLReader:
        """A reader of this class's stages."""
        return StageReader(cls)

    @classmethod
    def load(cls, path: str, key: str | bytes | None = None) -> Self:
        """Load a stage saved by :meth:`save`; ``key`` checks its HMAC (see the module doc)."""
        return cast(Self, StageReader(cls, key=key).load(path))
