"""The prepare_data cache key: what makes two preparations the same dataset.

sha256 of the analyzed plan's semantic hash, the schema, ``df.inputFiles()`` with sizes and
modification times (so rewritten source files are not served stale), the preparation params that
change the content and the store paths (see :mod:`spark_estimators.data.prepare`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from spark_estimators.data.metadata import FORMAT_VERSION
from spark_estimators.store.base import StoreBase

logger = logging.getLogger(__name__)

__all__ = ["compute_cache_key", "input_file_stats"]


def compute_cache_key(df: Any, params: dict[str, Any], store: StoreBase) -> str:
    """sha256 of the plan's semantic hash, input files (size, mtime), params and store paths."""
    material = {
        "format": FORMAT_VERSION,
        "plan": int(df.semanticHash()),
        "schema": df.schema.json(),
        "inputs": input_file_stats(df),
        "params": params,
        "store": [store.prefix_path, store.get_train_data_path(), store.get_val_data_path()],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def input_file_stats(df: Any) -> list[list[Any]]:
    """``[path, size, mtime]`` of every file the plan reads (sizes/mtimes from Hadoop's FS)."""
    files = sorted(df.inputFiles())
    if not files:
        return []
    try:
        spark = df.sparkSession
        jvm = spark.sparkContext._jvm
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        by_dir: dict[str, dict[str, tuple[int, int]]] = {}
        out: list[list[Any]] = []
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


def _stat_with_pyarrow(files: list[str]) -> list[list[Any]]:
    """``[path, size, mtime]`` through pyarrow's filesystems (Spark Connect clients).

    A file this process cannot see (another machine's local path, a scheme pyarrow lacks) keys
    the cache by its name only, and a warning says so: a rewritten file of the same name would
    then be served from the cache.
    """
    import pyarrow.fs as pafs

    out: list[list[Any]] = []
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
