"""The prepare_data cache key: what makes two preparations the same dataset.

sha256 of the plan's fingerprint, the schema, ``df.inputFiles()`` with sizes and modification
times (so rewritten source files are not served stale), the preparation params that change the
content and the store paths (see :mod:`spark_estimators.data.prepare`).

The plan's fingerprint (:func:`plan_fingerprint`) is its semantic hash, except where that hash
changes between two DataFrames built the same way (issue 25):

- every plan through an ML transformer: VectorAssembler, StringIndexerModel,
  StandardScalerModel, ... compute their column with a ScalaUDF, and a ScalaUDF's hash is its
  closure object's identity, new at every ``transform``;
- every plan that reads files, in another driver process: a file relation's hash includes its
  file format's JVM identity hash, so a new driver never found the dataset an earlier one wrote.

Such plans get a fingerprint of their content instead:

- classic sessions: the canonicalized analyzed plan as JSON (complete, never truncated; the JVM's
  id removed, so another driver process gets the same), each ScalaUDF's function by the sha256
  of its Java serialization (so a scaler fitted on other data, or an indexer with other labels,
  differs), and each leaf (a file relation by format, options, root paths and schemas; others
  by semantic hash: local data by content, an RDD-backed leaf by the RDD's id, so such plans are
  not reused). A plan with another opaque part (an expression the JSON cannot show, e.g. a
  Python UDF or a subquery) keeps the semantic hash. ML stages' uids, new for every instance
  (VectorAssembler writes its uid into the aliases of the columns it casts), are renumbered in
  the JSON and the functions (:class:`_StageUids`), so a notebook cell that builds and fits the
  same pipeline again hits (issue 41).
- Spark Connect (plans with an ML transformer or a file source): the plan the client sends (its
  protobuf) without its plan ids and stage uids: a transformer's name and params, the input's
  format, paths and options, local data by content. A
  fitted model is referenced by its server-side id, so a refitted model misses (a new dataset),
  never hits wrongly. Plans that name tables, views or SQL keep the server's semantic hash, since
  the name alone does not say what it reads.

Any miss only costs a new preparation; a wrong hit would train on stale data, so whatever cannot
be fingerprinted surely falls back to the semantic hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from spark_estimators.data.metadata import FORMAT_VERSION
from spark_estimators.store.base import StoreBase

if TYPE_CHECKING:
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.message import Message
    from py4j.java_gateway import JavaObject
    from pyspark.sql import DataFrame

#: ``[path, size, mtime]`` of one input file (size and mtime None when it cannot be seen).
FileStat = list[str | int | None]

logger = logging.getLogger(__name__)

__all__ = ["compute_cache_key", "input_file_stats", "plan_fingerprint"]

_SCALA_UDF = "org.apache.spark.sql.catalyst.expressions.ScalaUDF"
_JVM_ID_RE = re.compile(r'"jvmId":"[^"]*"')
#: Fields the plan JSON shows as null although they are settings, not content (ANSI mode).
_SETTING_FIELDS = frozenset({"evalMode", "evalContext"})
#: Connect relations that name what they read rather than describe it.
_NAMED_RELATIONS = frozenset(
    {"sql", "named_table", "cached_remote_relation", "cached_local_relation"}
)


def compute_cache_key(df: DataFrame, params: Mapping[str, object], store: StoreBase) -> str:
    """sha256 of the plan's fingerprint, input files (size, mtime), params and store paths."""
    material = {
        "format": FORMAT_VERSION,
        "plan": plan_fingerprint(df),
        "schema": df.schema.json(),
        "inputs": input_file_stats(df),
        "params": params,
        "store": [store.prefix_path, store.get_train_data_path(), store.get_val_data_path()],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def plan_fingerprint(df: DataFrame) -> int | dict[str, object]:
    """What identifies ``df``'s plan: its semantic hash, or its content (see the module doc).

    An int (the semantic hash) for plans it is stable for (``spark.range``, local data), or a
    dict for plans through ML transformers or reading files (see the module docstring).
    """
    try:
        if getattr(df, "_jdf", None) is not None:
            content = _classic_content_plan(df)
        else:
            content = _connect_ml_plan(df)
    except Exception as exc:  # noqa: BLE001 - any surprise: the semantic hash is always safe
        logger.debug("cannot fingerprint the plan's content (%s); using its semantic hash", exc)
        content = None
    return content if content is not None else int(df.semanticHash())


def _classic_content_plan(df: DataFrame) -> dict[str, object] | None:
    plan = df._jdf.queryExecution().analyzed().canonicalized()
    text = str(plan.toJSON())
    leaves = plan.collectLeaves()
    leaf_list = [leaves.apply(i) for i in range(leaves.size())]
    if f'"{_SCALA_UDF}"' not in text and not any(map(_is_file_relation, leaf_list)):
        return None  # neither a ScalaUDF nor a file relation: the semantic hash is stable
    nodes = json.loads(text)
    for node in nodes:
        if node.get("num-children", 0) and _opaque(node):
            return None
    jvm = df.sparkSession.sparkContext._jvm
    assert jvm is not None  # a classic session (Connect has its own path)
    uids = _StageUids()
    functions = [
        hashlib.sha256(
            uids.normalize_bytes(bytes(jvm.org.apache.spark.util.Utils.serialize(udf.function())))
        ).hexdigest()
        for udf in _scala_udfs(plan, [f'"{_SCALA_UDF}"' in json.dumps(node) for node in nodes])
    ]
    plan_text = uids.normalize_text(_JVM_ID_RE.sub("", text))
    return {
        "plan_json": hashlib.sha256(plan_text.encode()).hexdigest(),
        "udf_functions": functions,
        "leaves": [_leaf_fingerprint(leaf) for leaf in leaf_list],
    }


class _StageUids:
    """Renumbers ML stages' uids (``VectorAssembler_3f9c0a1b2c4d``) by first appearance.

    A stage's uid is new for every instance, and some transformers write it into the plan:
    VectorAssembler casts each non-double input as ``<col>_double_<uid>`` (issue 41), so the
    same pipeline built again in a re-run notebook cell never hit. Only names of the form
    ``<Stage>_<12 hex digits>`` where ``<Stage>`` is a loaded ML stage class (pyspark's or the
    user's :class:`~pyspark.ml.util.Identifiable` subclasses: their uid prefix) are renumbered,
    so a user's string literal is left alone unless it is spelled exactly like a stage's uid;
    renumbering (not erasing) keeps two stages of one plan apart. A uid never changes what the
    data holds, only column and field names. A fitted model's state (an indexer's labels, a
    scaler's means) is in its function's serialization, which stays in the key.
    """

    def __init__(self) -> None:
        # longest first: ``StringIndexerModel_<uid>`` is read whole, not as ``StringIndexer``
        names = sorted(_stage_class_names(), key=len, reverse=True)
        self._uid_re = re.compile(
            "(" + "|".join(map(re.escape, names)) + r")_([0-9a-f]{12})(?![0-9A-Za-z])"
        )
        self._numbers: dict[str, str] = {}

    def _renumber(self, match: re.Match[str]) -> str:
        # same length as the uid: Java serialization's string lengths stay right
        number = self._numbers.setdefault(match.group(2), f"{len(self._numbers):012x}")
        return f"{match.group(1)}_{number}"

    def normalize_text(self, text: str) -> str:
        """``text`` with every stage uid renumbered."""
        return self._uid_re.sub(self._renumber, text)

    def normalize_bytes(self, data: bytes) -> bytes:
        """The same for a Java serialization (uids are ASCII there; other bytes are kept)."""
        return self.normalize_text(data.decode("latin-1")).encode("latin-1")


def _stage_class_names() -> frozenset[str]:
    """Names of the loaded :class:`pyspark.ml.util.Identifiable` subclasses (uid prefixes)."""
    from pyspark.ml.util import Identifiable

    seen: set[type] = set()
    pending: list[type] = [Identifiable]
    while pending:
        subclasses: list[type] = pending.pop().__subclasses__()
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
    return frozenset(cls.__name__ for cls in seen)


def _is_file_relation(leaf: JavaObject) -> bool:
    return bool(
        leaf.getClass().getName().endswith(".LogicalRelation")
        and leaf.relation().getClass().getName().endswith(".HadoopFsRelation")
    )


def _leaf_fingerprint(leaf: JavaObject) -> list[str] | int:
    """A leaf plan node's content, the same in every driver process where it can be.

    A file relation's semantic hash involves its file format's JVM identity (another driver
    process gets another number), so it is described by format, options, root paths and schemas
    (which files and their sizes and times are in the key already). Other leaves by their
    semantic hash: local data by content, an RDD by its id (never reused wrongly).
    """
    if _is_file_relation(leaf):
        relation = leaf.relation()
        return [
            str(relation.fileFormat().getClass().getName()),
            str(relation.options().toString()),
            str(relation.location().rootPaths().toString()),
            str(relation.dataSchema().json()),
            str(relation.partitionSchema().json()),
            str(relation.bucketSpec().toString()),
        ]
    return int(leaf.semanticHash())


def _opaque(value: object, cls: str = "", key: str = "") -> bool:
    """True when a plan node's JSON hides content (a null that is not a ScalaUDF's function)."""
    if isinstance(value, dict):
        cls = value.get("class", cls)
        return any(_opaque(v, cls, k) for k, v in value.items())
    if isinstance(value, list):
        return any(_opaque(v, cls, key) for v in value)
    if value is None:
        return not (
            (cls == _SCALA_UDF and key == "function")
            or key in _SETTING_FIELDS
            or cls.endswith(".Literal")
        )
    return False


def _scala_udfs(plan: JavaObject, has_udf: Sequence[bool] | None = None) -> list[JavaObject]:
    """The ScalaUDF expressions of a JVM plan, in a fixed order (nodes, then expressions).

    ``has_udf``: per plan node in pre-order (the order of ``plan.toJSON()``), whether its JSON
    names a ScalaUDF; the expressions of the others are not walked (each step of the walk is a
    py4j call: ~0.04 s of a small fit's ``prepare_data``, issue 45). If the plan's nodes do not
    match that list, every node is walked.
    """
    found: list[JavaObject] = []
    position = 0

    def visit_expression(expr: JavaObject) -> None:
        if expr.getClass().getName() == _SCALA_UDF:
            found.append(expr)
        children = expr.children()
        for i in range(children.size()):
            visit_expression(children.apply(i))

    def visit_plan(node: JavaObject) -> None:
        nonlocal position
        here, position = position, position + 1
        if has_udf is None or here >= len(has_udf) or has_udf[here]:
            expressions = node.expressions()
            for i in range(expressions.size()):
                visit_expression(expressions.apply(i))
        children = node.children()
        for i in range(children.size()):
            visit_plan(children.apply(i))

    visit_plan(plan)
    if has_udf is not None and position != len(has_udf):  # not the JSON's nodes: walk them all
        return _scala_udfs(plan)
    return found


def _connect_ml_plan(df: DataFrame) -> dict[str, object] | None:
    plan = getattr(df, "_plan", None)
    session = getattr(df, "sparkSession", None)
    if plan is None or session is None:
        return None
    proto = plan.to_proto(session.client)
    if not (_has_field(proto, "ml_relation") or _has_field(proto, "data_source")):
        return None  # neither an ML transformer nor files: the server's hash is stable
    if any(_has_field(proto, name) for name in _NAMED_RELATIONS):
        return None
    _strip_ids(proto)
    return {"connect_plan": hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()}


def _submessages(field: FieldDescriptor, value: object) -> list[Message]:
    """The messages held by one set field of a protobuf message (maps by their values)."""
    if field.message_type is None:
        return []
    if field.message_type.GetOptions().map_entry:
        items = list(cast("Mapping[object, Message]", value).values())
    elif _is_repeated(field):
        items = list(cast("Iterable[Message]", value))
    else:
        items = [cast("Message", value)]
    return [item for item in items if hasattr(item, "ListFields")]


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones have ``label``
    if repeated is None:
        return bool(field.label == field.LABEL_REPEATED)
    return bool(repeated() if callable(repeated) else repeated)


def _has_field(message: Message, name: str) -> bool:
    for field, value in message.ListFields():
        if field.name == name:
            return True
        if any(_has_field(item, name) for item in _submessages(field, value)):
            return True
    return False


def _strip_ids(message: Message, plan_ids: dict[int, int] | None = None) -> None:
    """Make equal plans equal: transformers' ``uid`` cleared, ``plan_id``s renumbered.

    Plan ids count up in the client for every DataFrame; column references use them too
    (``df["x"]`` after a self-join), so they are renumbered by first appearance, not dropped.
    """
    plan_ids = {} if plan_ids is None else plan_ids
    for field, value in message.ListFields():
        if field.message_type is None:
            if field.name == "uid":
                message.ClearField(field.name)
            elif field.name == "plan_id":
                setattr(message, field.name, plan_ids.setdefault(int(value), len(plan_ids)))
            continue
        for item in _submessages(field, value):
            _strip_ids(item, plan_ids)


def input_file_stats(df: DataFrame) -> list[FileStat]:
    """``[path, size, mtime]`` of every file the plan reads (sizes/mtimes from Hadoop's FS)."""
    files = sorted(df.inputFiles())
    if not files:
        return []
    try:
        spark = df.sparkSession
        jvm = spark.sparkContext._jvm
        assert jvm is not None  # a classic session
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        by_dir: dict[str, dict[str, tuple[int, int]]] = {}
        out: list[FileStat] = []
        for f in files:
            parent = f.rsplit("/", 1)[0]
            if parent not in by_dir:
                jpath = jvm.org.apache.hadoop.fs.Path(parent)
                statuses = jpath.getFileSystem(conf).listStatus(jpath)
                by_dir[parent] = {
                    s.getPath().getName(): (int(s.getLen()), int(s.getModificationTime()))
                    for s in statuses
                }
            size, mtime = by_dir[parent].get(f.rsplit("/", 1)[1], (-1, -1))
            out.append([f, size, mtime])
        return out
    except Exception as exc:  # Spark Connect has no JVM handle: stat them from here
        logger.debug("cannot stat input files through Spark (%s); trying pyarrow", exc)
        return _stat_with_pyarrow(files)


def _stat_with_pyarrow(files: list[str]) -> list[FileStat]:
    """``[path, size, mtime]`` through pyarrow's filesystems (Spark Connect clients).

    A file this process cannot see (another machine's local path, a scheme pyarrow lacks) keys
    the cache by its name only, and a warning says so: a rewritten file of the same name would
    then be served from the cache.
    """
    import pyarrow.fs as pafs

    out: list[FileStat] = []
    unseen = []
    for f in files:
        try:
            fs, path = pafs.FileSystem.from_uri(f)
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                raise FileNotFoundError(path)
            mtime = info.mtime_ns // 1_000_000 if info.mtime_ns is not None else None
            out.append([f, info.size, mtime])
        except Exception:
            unseen.append(f)
            out.append([f, None, None])
    if unseen:
        logger.warning(
            "prepare_data cannot see %d input file(s) from this process (e.g. %s): the cache "
            "key uses their names only, so a file rewritten under the same name is not "
            "noticed; delete the dataset (store.delete_dataset) after changing the input",
            len(unseen),
            unseen[0],
        )
    return out
