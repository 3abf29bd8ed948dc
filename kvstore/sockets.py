"""Where a Unix socket may live: a directory that only its user (or root) can change.

A client that dials a Unix socket hands whoever listens there its bearer token and
its KV. A socket in a directory that another local user owns, or can write to, is
theirs to swap: the default ``$TMPDIR/kvstore-$UID`` is a predictable name, so
another user can make that directory before the server first starts. The server
refuses to listen in such a directory (``server/main.py``), and the SDK refuses to
dial its default socket in one (``kvstore.sdk.endpoint``); both ask ``untrusted_reason``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator


def untrusted_reason(directory: str, uid: int | None = None) -> str | None:
    """Why ``directory`` cannot guard a Unix socket of user ``uid`` (default: this
    process's effective user), or None if it can.

    It can when it is a directory, not a symlink to one, and it and every directory
    above it (as named and as resolved) belong to ``uid`` or root and are writable by
    nobody else. A sticky directory (``/tmp``) may be writable by all: others cannot
    rename or delete what is not theirs in it. Symlinks on the way must belong to
    ``uid`` or root too: whoever owns one can point it elsewhere.
    """
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(directory)
    except OSError as e:
        return f"{directory}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symlink (name the directory it points to instead)"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    absolute = os.path.abspath(directory)
    seen: set[str] = set()
    for path in (*_up(absolute), *_up(os.path.realpath(absolute))):
        if path in seen:
            continue
        seen.add(path)
        why = _reason(path, uid)
        if why:
            return why
    return None


def _up(path: str) -> Iterator[str]:
    """``path`` and each directory above it, up to ``/``."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _reason(path: str, uid: int) -> str | None:
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode) and mode & 0o022 and not mode & stat.S_ISVTX:
        who = "others" if mode & 0o002 else "its group"
        return f"{path} is writable by {who} (mode {mode:04o})"
    return None
