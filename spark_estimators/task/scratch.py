"""Scratch space of a rank: temp dirs that go away with the rank, however it ends.

The Spark task makes one scratch dir per rank process (under the rank's ``TMPDIR``: ``env=``
can move it) and names it in ``SPARK_ESTIMATORS_RANK_SCRATCH``. Our training code makes its temp
dirs inside it with :func:`make_temp_dir`, and a path that must live elsewhere (a fixed path, the
same on every attempt of a run) is registered with :func:`remove_at_rank_exit`. When the rank
process exits, even when it was killed by the abort of a failed job and ran no ``finally``, the
task removes the scratch dir and every registered path. The user's own ``TMPDIR`` is left as it
is: ranks on one host still share ``tempfile.gettempdir()``.

Outside a rank (tests, the driver) both helpers fall back to the plain temp dir, and the caller
alone is responsible for removing what it made.

When the task itself dies (its executor or Python worker killed), nothing removed its scratch
dir. So each scratch dir names its task process in ``.owner`` (boot id, pid namespace, pid and
start time, :mod:`spark_estimators._base.liveness`), and :func:`create_scratch` first removes the
``se-rank-*`` dirs in the same parent whose owner is gone from this host (with the paths they
listed). A task process that exits normally while a scratch dir is still there (an interpreter
shutdown in the middle of a task) removes it at exit. Dirs without ``.owner`` (made by an
earlier version) are left alone.

The temp dir is shared with the host's other users, so that cleanup trusts only what it can prove
is ours (:mod:`spark_estimators._base.owned`): a ``se-rank-*`` dir counts only when it is a real
directory of our user that nobody else may enter (``mkdtemp`` makes it so), its ``.owner`` and
``.remove-at-exit`` only when they are regular files of ours inside it, and a listed path is
removed only when it is a directory of ours (never through a link). A stranger's planted dir,
whatever its ``.owner`` and list say, is left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile

from spark_estimators import envvars as ev
from spark_estimators._base.liveness import is_gone, process_id
from spark_estimators._base.owned import is_owned, is_private_dir, read_owned_file

logger = logging.getLogger(__name__)

#: The list of extra paths to remove, one per line, inside the scratch dir.
_MANIFEST = ".remove-at-exit"
#: Who made the scratch dir (see the module docstring).
_OWNER = ".owner"
PREFIX = "se-rank-"
#: Scratch dirs this process made and has not removed yet (removed at exit).
_live: set[str] = set()


def scratch_root() -> str | None:
    """The rank's scratch dir; None outside a rank (``dir=None`` means the plain temp dir)."""
    base = os.environ.get(ev.RANK_SCRATCH)
    return base if base and os.path.isdir(base) else None


def make_temp_dir(prefix: str) -> str:
    """A new temp dir in the rank's scratch dir (or the temp dir outside a rank)."""
    return tempfile.mkdtemp(prefix=prefix, dir=scratch_root())


def remove_at_rank_exit(path: str) -> None:
    """Have the task remove ``path`` once this rank process has exited (no-op outside a rank)."""
    base = scratch_root()
    if base is not None:
        with open(os.path.join(base, _MANIFEST), "a", encoding="utf-8") as f:
            f.write(os.path.abspath(path) + "\n")


def create_scratch(env: dict[str, str]) -> str | None:
    """Task side: make the scratch dir of one rank and name it in ``env`` (None if impossible)."""
    for base in (env.get("TMPDIR") or None, None):
        with contextlib.suppress(OSError):
            remove_orphans(base or tempfile.gettempdir())
            path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
            with open(os.path.join(path, _OWNER), "w", encoding="utf-8") as f:
                json.dump(process_id(), f)
            if not _live:
                atexit.register(_remove_live)
            _live.add(path)
            env[ev.RANK_SCRATCH] = path
            return path
    return None


def remove_orphans(base: str) -> list[str]:
    """Remove the scratch dirs in ``base`` whose task process is gone; returns them."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        if not is_private_dir(path):
            continue  # another user's (or a link): never ours to remove
        text = read_owned_file(os.path.join(path, _OWNER))
        try:
            owner = json.loads(text) if text is not None else None
            gone = owner is not None and is_gone(
                str(owner["host_id"]), int(owner["pid"]), str(owner["start"])
            )
        except (ValueError, KeyError, TypeError):
            continue  # not ours to judge: no owner file (an earlier version), or unreadable
        if gone:
            remove_scratch(path)
            removed.append(path)
    if removed:
        logger.info("removed %d scratch dir(s) left by killed tasks in %s", len(removed), base)
    return removed


def _remove_live() -> None:
    for path in list(_live):
        remove_scratch(path)


def remove_scratch(path: str | None) -> None:
    """Task side, after the rank exited: remove its scratch dir and the paths it registered."""
    if path is None:
        return
    _live.discard(path)
    if not is_private_dir(path):
        return  # not (or no longer) a scratch dir of ours: leave it
    listed = read_owned_file(os.path.join(path, _MANIFEST)) or ""
    for line in listed.splitlines():
        target = line.strip()
        if os.path.isabs(target) and is_owned(target):
            shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
