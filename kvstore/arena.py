"""The L1 arena: a shared-memory file both sides map, and copies over extents.

A record in the arena lives in one or more *extents*, ``(offset, length)`` pairs
of arena byte offsets, laid out in order: the record's byte ``i`` is found by
walking the extents. The tier (``kvstore.engine.tiers.memory``) owns the file, its
page allocator and its holds (``kvstore.engine.tiers.pages``); other processes on
the host map the same file with ``ArenaView.open(path)`` and read or write the
extents the server hands them, so chunk bytes never cross a socket. This module is
in the core because both peers above it, the engine and the SDK, map the file and
must agree on its layout; it is the core's one module that maps memory and makes
files (docs/architecture.md).

Copies go through numpy slice assignment (memcpy speed, GIL released) or
``bytes.join`` over memoryview slices: one Python step per extent, never per
page. The allocator coalesces free runs, so the extents of one record are never
adjacent to each other and there is nothing left to merge. A range inside one
extent (most records: ``alloc`` tries one contiguous run first) skips the extent
walk: at 1 MiB a copy takes ~35 us, so each microsecond of bookkeeping is ~3%.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import tempfile
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from kvstore import accel
from kvstore.errors import ConfigError, InvalidArgument, StoreClosed, TierError

Extent = tuple[int, int]
"""(offset, length): a run of arena bytes (or of pages, inside the allocator)."""


def spans(extents: Sequence[Extent], start: int, length: int) -> Iterator[tuple[int, int, int]]:
    """(arena offset, position in the data, bytes) covering record bytes [start, start+length)."""
    if start < 0 or length < 0:
        raise InvalidArgument(f"bad range start={start} length={length}")
    pos = 0  # record offset of the current extent
    done = 0
    for off, n in extents:
        if done == length:
            return
        lo = max(start + done, pos)
        if lo < pos + n:
            take = min(pos + n - lo, length - done)
            yield off + lo - pos, done, take
            done += take
        pos += n
    if done != length:
        raise InvalidArgument(
            f"range [{start}, {start + length}) runs past the extents ({pos} bytes)"
        )


_U8 = np.dtype(np.uint8)
_SMALL = 64 * 1024  # bytes copied with the GIL held (a memoryview copy): no numpy set-up


def _one_extent(extents: Sequence[Extent], start: int, length: int) -> int:
    """The arena offset of record bytes [start, start+length) if one extent holds the whole
    record (the common case: a slice, no walk); -1 if the extents must be walked."""
    if len(extents) == 1 and start >= 0 and length >= 0 and start + length <= extents[0][1]:
        return extents[0][0] + start
    return -1


def flat_view(buf: object) -> memoryview:
    """A flat byte view of any C-contiguous buffer, without numpy (a put's payload:
    ~0.3 us against ~2 us for ``as_u8``, ~4 us with cold caches)."""
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as e:
        raise InvalidArgument(f"expected a buffer, got {type(buf).__name__}") from e
    if not mv.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def as_u8(buf: object, *, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of any C-contiguous buffer (bytes, memoryview, numpy, ...)."""
    if isinstance(buf, np.ndarray):
        arr = buf
        if arr.dtype is _U8 and arr.ndim == 1:  # as is: no view to make (per-call cost)
            if not arr.flags.c_contiguous:
                raise InvalidArgument("buffer must be C-contiguous")
            if writable and not arr.flags.writeable:
                raise InvalidArgument("output buffer is read-only")
            return arr
    else:
        mv = flat_view(buf)
        if writable and mv.readonly:
            raise InvalidArgument("output buffer is read-only")
        return np.frombuffer(mv, np.uint8)
    if not arr.flags.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidArgument("output buffer is read-only")
    return arr.reshape(-1).view(np.uint8)


def default_arena_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvstore-{os.getpid()}-{secrets.token_hex(4)}")


_DEFAULT_NAME = re.compile(r"kvstore-(\d+)-[0-9a-f]{8}")


def remove_stale_arenas(directory: str) -> list[str]:
    """Unlink default-named arena files whose tier died without closing them (kill -9).

    An arena is only unlinked by the tier that made it, so each crash would leave
    its whole size behind in /dev/shm (memory, not disk). A file is stale when the
    process named in it is gone and no tier holds its flock; the pid check keeps a
    tier that has created its file but not locked it yet from losing it.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _DEFAULT_NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a live tier holds it
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


ARENA_XATTR = "user.kvstore.arena"
"""Marks a file as a kvstore arena (the value names the pid that made it): a file at an
explicit ``memory.path`` is taken over after a crash only if it carries the mark."""


def _mark(fd: int) -> None:
    # A filesystem without user xattrs (tmpfs before Linux 6.6) cannot carry the mark:
    # such an arena, left by a kill -9 at an explicit path, is refused, never taken.
    with contextlib.suppress(OSError):
        os.setxattr(fd, ARENA_XATTR, f"pid={os.getpid()}".encode())


def _marked(fd: int) -> bool:
    try:
        return os.getxattr(fd, ARENA_XATTR).startswith(b"pid=")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class ArenaView:
    """A mapping of an arena file: the tier's own, or another process's view of it.

    Other processes call ``ArenaView.open(path)`` with the path the server gave
    them, then ``write``/``read_into`` at the extents of a reservation or lease.
    """

    def __init__(
        self,
        path: str,
        fd: int,
        size: int,
        *,
        writable: bool,
        populate: bool,
        owner: bool = False,
        growing: bool = False,
        offset: int = 0,
    ) -> None:
        flags = mmap.MAP_SHARED
        if populate and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE  # map every page now, not on first touch mid-copy
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm: mmap.mmap | None = None
        try:
            if growing:
                array = _map_past_end(fd, size, prot, flags)
            else:
                self._mm = mmap.mmap(fd, size, flags=flags, prot=prot, offset=offset)
                array = np.frombuffer(self._mm, dtype=np.uint8)
        except OSError as e:
            raise TierError(f"cannot map arena {path} ({size} bytes): {e}") from e
        self.path = path
        self.size = size
        self.writable = writable
        self._fd = fd if owner else None  # the owner keeps its fd: it holds the flock
        self._unlink_pid = os.getpid() if owner else None
        self._mv: memoryview | None = array.data
        self._array: np.ndarray | None = array

    @classmethod
    def open(
        cls,
        path: str,
        size: int | None = None,
        *,
        writable: bool = True,
        populate: bool = False,
        growing: bool = False,
        offset: int = 0,
        inode: int | None = None,
    ) -> ArenaView:
        """Map an existing arena file (``size`` defaults to the file's size).

        ``populate`` maps every page now: slower to open (~0.6 s per GiB here),
        but no page faults later; first touches otherwise copy at ~1.5 GB/s.
        ``growing``: a file that grows in place up to ``size`` (L2's LMDB file, whose
        loans are read here): mapped whole now, though only what the file holds may be
        read (a page past its end raises SIGBUS).
        ``offset``: map only ``size`` bytes from there (a multiple of the page size; the
        presence filter's region, ``kvstore.presence``).
        ``inode``: the file a server offered (its Info); a path that names another file
        here (a server restarted elsewhere, another host's path) raises ``TierError``.
        Checked on the opened file, so the path cannot change between check and map.
        """
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise TierError(f"cannot open arena {path}: {e}") from e
        try:
            try:
                st = os.fstat(fd)
            except OSError as e:  # callers catch this module's errors only
                raise TierError(f"cannot stat arena {path}: {e}") from e
            if inode is not None and st.st_ino != inode:
                raise TierError(f"{path} here is not the file the server offered (inode differs)")
            actual = st.st_size
            size = actual - offset if size is None else size
            if growing and offset:
                raise InvalidArgument("a growing file is mapped from its start")
            if size <= 0 or offset < 0 or (offset + size > actual and not growing):
                raise InvalidArgument(
                    f"arena {path} is {actual} bytes; cannot map {size} from {offset}"
                )
            return cls(
                path, fd, size, writable=writable, populate=populate, growing=growing,
                offset=offset,
            )  # fmt: skip
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file

    @classmethod
    def own(cls, path: str, size: int, *, create: bool) -> ArenaView:
        """The tier's mapping: create the file, back it, lock it against a second tier.

        With ``create`` the file is made here and unlinked by ``close``. A file already
        at ``path`` is taken over only if it is provably a kvstore arena whose tier is
        gone (the ``ARENA_XATTR`` mark, and no tier holds its flock): an operator's
        ``--shm-path`` naming some other file must not have it truncated and then
        deleted. Without ``create`` the file must exist and is kept.

        The file is fully allocated up front: on tmpfs a file can be larger than
        the memory behind it, and touching an unbacked page kills the process
        with SIGBUS in the middle of a copy; here it is a clear error instead.
        """
        made = False
        try:
            if create:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    made = True
                except FileExistsError:
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            else:
                fd = os.open(path, os.O_RDWR)
        except OSError as e:
            why = "it is a symlink" if os.path.islink(path) else e.strerror
            raise ConfigError(f"memory.path={path}: cannot open the arena file: {why}") from e
        ours = False  # made here, or a dead tier's arena: close() may unlink it
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise TierError(f"arena {path} is in use by another memory tier") from e
            if create:
                if not made and not _marked(fd):
                    raise ConfigError(
                        f"memory.path={path}: the file exists and is not an arena left by a "
                        "kvstore server that is gone; the server creates its arena file "
                        "itself and deletes it at shutdown: name a path that does not exist"
                    )
                ours = True
                if not made:
                    # A dead server's arena: its clients may still map it (its pages, the
                    # presence filter in it), so it is replaced by a new file, never cut
                    # short (a read past its end is SIGBUS) or rewritten under them.
                    os.unlink(path)
                    try:
                        new = os.open(
                            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
                        )
                    except OSError as e:  # the path is not this tier's to clean up now
                        ours = False
                        why = (
                            "another process made it meanwhile"
                            if isinstance(e, FileExistsError)
                            else e.strerror
                        )
                        raise TierError(
                            f"arena {path}: a dead server's file was removed, but a new one "
                            f"could not be made in its place: {why}"
                        ) from e
                    os.close(fd)
                    fd = new
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # just made: nobody holds it
                try:
                    vfs = os.fstatvfs(fd)  # refuse early rather than fill tmpfs, then fail
                    if size > vfs.f_bavail * vfs.f_frsize + os.fstat(fd).st_blocks * 512:
                        raise OSError(28, f"only {vfs.f_bavail * vfs.f_frsize} bytes free")
                    _mark(fd)
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise TierError(
                        f"cannot back a {size}-byte arena at {path}: {e} "
                        f"(is {os.path.dirname(path)} large enough?)"
                    ) from e
            elif os.fstat(fd).st_size < size:
                raise ConfigError(f"arena {path} is {os.fstat(fd).st_size} bytes, need {size}")
            view = cls(path, fd, size, writable=True, populate=True, owner=True)
            view._unlink_pid = os.getpid() if create else None
            return view
        except BaseException:
            os.close(fd)
            if ours:  # never a file another live tier holds, nor one this tier did not make
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise

    # -- access ---------------------------------------------------------------
    @property
    def array(self) -> np.ndarray:
        """The whole arena as a flat uint8 array (writable if mapped writable)."""
        if self._array is None:
            raise StoreClosed(f"arena view of {self.path} is closed")
        return self._array

    @property
    def closed(self) -> bool:
        return self._array is None

    def _view(self) -> memoryview:
        if self._mv is None:
            raise StoreClosed(f"arena view of {self.path} is closed")
        return self._mv

    def write(self, extents: Sequence[Extent], start: int, data: object) -> None:
        """Copy ``data`` into the record bytes starting at ``start``."""
        if type(data) is bytes and len(data) <= _SMALL:  # a header: no numpy set-up
            mv = self._view()
            if (off := _one_extent(extents, start, len(data))) >= 0:
                mv[off : off + len(data)] = data
                return
            view = memoryview(data)
            for off, pos, n in spans(extents, start, len(data)):
                mv[off : off + n] = view[pos : pos + n]
            return
        size = memoryview(data).nbytes  # type: ignore[arg-type]
        if (off := _one_extent(extents, start, size)) >= 0:
            accel.copy(self._view()[off : off + size], data)
            return
        arr, src = self.array, as_u8(data)
        for off, pos, n in spans(extents, start, size):
            arr[off : off + n] = src[pos : pos + n]

    def read_into(self, extents: Sequence[Extent], start: int, out: object) -> None:
        """Fill ``out`` (any writable buffer) from the record bytes starting at ``start``."""
        arr, dst = self.array, as_u8(out, writable=True)
        size = dst.size
        if (off := _one_extent(extents, start, size)) >= 0:
            dst[:] = arr[off : off + size]
            return
        for off, pos, n in spans(extents, start, size):
            dst[pos : pos + n] = arr[off : off + n]

    def write_hashed(self, extents: Sequence[Extent], start: int, data: object) -> int:
        """``write``, returning the xxh3_64 of the bytes as they are in the arena after
        the copy (``accel.scatter_xxh3``: one pass with AVX2, else each block hashed
        right after it is copied, while still in cache)."""
        return self._copy_hashed(extents, start, as_u8(data), True)

    def read_into_hashed(self, extents: Sequence[Extent], start: int, out: object) -> int:
        """``read_into``, returning the xxh3_64 of the bytes delivered into ``out``.

        Verifying a read this way costs about one pass over the bytes, not two. What is
        hashed is what the caller got, even if a rogue writer changes the arena meanwhile.
        """
        return self._copy_hashed(extents, start, as_u8(out, writable=True), False)

    def _copy_hashed(
        self, extents: Sequence[Extent], start: int, buf: np.ndarray, into_arena: bool
    ) -> int:
        size = buf.size
        if (off := _one_extent(extents, start, size)) >= 0:
            return accel.scatter_xxh3(self.array, buf, ((off, 0, size),), into_arena)
        return accel.scatter_xxh3(self.array, buf, list(spans(extents, start, size)), into_arena)

    def read(self, extents: Sequence[Extent], start: int, length: int) -> bytes:
        """A bytes copy of record bytes [start, start+length): one memcpy per extent."""
        mv = self._view()
        if (off := _one_extent(extents, start, length)) >= 0:
            return mv[off : off + length].tobytes()
        return b"".join([mv[off : off + n] for off, _, n in spans(extents, start, length)])

    def equals(self, extents: Sequence[Extent], start: int, data: bytes) -> bool:
        """Whether record bytes [start, start+len(data)) are ``data``.

        Through a bytes copy: ``memoryview == bytes`` compares item by item (~4 us per KiB
        here), a copy and ``bytes ==`` (memcmp) take ~0.4 us.
        """
        return self.read(extents, start, len(data)) == data

    def checksum(self, extents: Sequence[Extent], start: int, length: int) -> int:
        """xxh3_64 of record bytes [start, start+length), streamed over the extents."""
        mv = self._view()
        if (off := _one_extent(extents, start, length)) >= 0:
            return xxhash.xxh3_64_intdigest(mv[off : off + length])
        h = xxhash.xxh3_64()
        for off, _, n in spans(extents, start, length):
            h.update(mv[off : off + n])
        return h.intdigest()

    def close(self) -> None:
        """Unmap. A view still exported elsewhere keeps the mapping alive until it dies."""
        self._array = None
        if self._mv is not None:
            with contextlib.suppress(BufferError):
                self._mv.release()
            self._mv = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a numpy view
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)  # drops the flock too
            self._fd = None
        if self._unlink_pid == os.getpid():  # a forked child must not delete its parent's arena
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._unlink_pid = None

    def __enter__(self) -> ArenaView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map_past_end(fd: int, size: int, prot: int, flags: int) -> np.ndarray:
    """``size`` bytes of the file ``fd`` mapped, though the file may be shorter now (it
    grows in place: pages past its end are never read). Python's mmap refuses a mapping
    past the end, so libc's is used; the mapping lives while any array over it does (the
    returned array's base owns it and unmaps it when the last view goes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    buf = (ctypes.c_uint8 * size).from_address(addr)
    # Not at exit: a daemon thread may still be copying out of it, and the process's
    # end unmaps it anyway.
    weakref.finalize(buf, libc.munmap, addr, size).atexit = False
    array = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    array.flags.writeable = bool(prot & mmap.PROT_WRITE)
    return array
