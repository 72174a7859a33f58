"""Files, directories and socket peers that this process can prove are its own user's.

A host is often shared with other users (YARN, standalone workers, a shared notebook server), and
the temp dir is writable by all of them. Whatever we find there, or whoever answers at an
address, is trusted only when the kernel says it belongs to our user:

- :func:`is_private_dir`: a real directory (not a link) owned by us that nobody else may write
  to or enter (``mkdtemp`` makes such dirs);
- :func:`read_owned_file`: a regular file owned by us, read without following a link;
- :func:`peer_uid`: the user of the process at the other end of a Unix socket (``SO_PEERCRED``),
  and :func:`same_user_peer`;
- :func:`private_dir`: a directory of ours, made if missing, refused if someone else made it.

``root`` is no exception: a directory that ``nobody`` planted is not root's, even though root
could delete it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct

_PEERCRED = struct.Struct("3i")
#: Group and other permission bits: a private directory has none.
_SHARED_BITS = 0o077


def is_private_dir(path: str) -> bool:
    """``path`` is a directory (not a link) of this user with no group/other permissions."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & _SHARED_BITS


def is_owned(path: str) -> bool:
    """``path`` exists, is not a link, and belongs to this user (``lstat``)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()


def read_owned_file(path: str, limit: int = 1 << 20) -> str | None:
    """The text of regular file ``path`` if this user owns it (a link is not followed); else None.

    At most ``limit`` bytes are read: a planted file cannot make us read a disk's worth.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            return f.read(limit).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None


def private_dir(parent: str, name: str) -> str | None:
    """``parent/name`` as a private directory of this user (made 0700 if missing).

    None when it exists but is not ours or others may enter it: someone else made it first, and
    nothing of ours goes in there.
    """
    path = os.path.join(parent, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return path if is_private_dir(path) else None


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process at the other end of Unix socket ``sock`` (None if unknown)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size)
        )
    except OSError:
        return None
    return pid, uid


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of Unix socket ``sock`` (None if unknown)."""
    creds = peer_credentials(sock)
    return None if creds is None else creds[1]


def same_user_peer(sock: socket.socket) -> bool:
    """The other end of ``sock`` runs as this user (True where ``SO_PEERCRED`` does not exist)."""
    if getattr(socket, "SO_PEERCRED", None) is None:
        return True
    return peer_uid(sock) == os.geteuid()
