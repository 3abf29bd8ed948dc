"""L2's on-disk formats: the directory's lock, opening LMDB and the checks of its files,
the per-chunk meta entry and the index read from them, and reading a record in place.

A meta value (sub-database ``meta``) is the chunk's version, flags, hits, record
size, last access (wall ms) and access sequence, then an xxh3_64 of all of it, then
the record header without its padding: the index is rebuilt from these at open.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
from dataclasses import dataclass

import lmdb
import xxhash

from kvstore import accel
from kvstore.config import MiB
from kvstore.engine.tiers.base import copy_into
from kvstore.errors import CorruptRecord, InvalidArgument, TierError
from kvstore.records import Codec, RecordHeader, decode_payload, parse_header, verify

# meta value: version, flags, hits, record size, last access (wall ms), access seq,
# then an xxh3_64 of everything else, then the record header without its padding.
_META = struct.Struct("<BBxxIQQQ")
_META_CHECK = struct.Struct("<Q")
META_FIXED = _META.size + _META_CHECK.size
_META_VERSION = 1
_PINNED = 1
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
LOCK_FILE = "kvstore.lock"
DATA_FILE = "data.mdb"

log = logging.getLogger(__name__)


# -- the directory ------------------------------------------------------------------
def lock_directory(path: str) -> tuple[int, ...]:
    """Keep every other process out of the LMDB directory ``path`` (made if missing);
    the fds that hold the locks, to be closed to release them.

    LMDB itself lets several processes share an environment, so kvstore's flocks are
    all that keep a second server out. The one on the directory is what holds:
    ``kvstore.lock`` can be deleted under a running server, and a second server
    would then lock a fresh file. The lock file is still locked too (servers that
    predate the directory lock take only that one) and holds the owner's pid.
    """
    try:
        # Records carry the prompts' token ids: only the server's user may read them
        # (same-host clients of that user read loans from data.mdb). An existing
        # directory keeps the mode its operator gave it.
        os.makedirs(path, mode=0o700, exist_ok=True)
        fds = [os.open(path, os.O_RDONLY | os.O_DIRECTORY)]
    except OSError as e:
        raise TierError(f"cannot create the disk tier directory {path}: {e}") from e
    try:
        _flock(fds[0], path)
        try:
            fds.append(os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as e:
            raise TierError(f"cannot create {os.path.join(path, LOCK_FILE)}: {e}") from e
        _flock(fds[1], path)
        os.ftruncate(fds[1], 0)
        os.pwrite(fds[1], f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return tuple(fds)


def _flock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise TierError(
            f"{path} is in use by another kvstore process (pid {_holder(path)}); "
            "stop it or give this one another disk path"
        ) from e


def _holder(path: str) -> str:
    """Who holds the directory's flock (``/proc/locks``: right even when kvstore.lock
    was deleted or rewritten), else the pid kvstore.lock names."""
    with contextlib.suppress(OSError, IndexError):
        st = os.stat(path)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
                fields = line.split()
                if fields[1] == "FLOCK" and fields[5] == inode:
                    return fields[4]
    with contextlib.suppress(OSError), open(os.path.join(path, LOCK_FILE)) as f:
        return f.read(32).strip() or "unknown"
    return "unknown"


def damaged(path: str, why: object) -> TierError:
    """The one refusal of an LMDB directory that cannot be opened safely."""
    return TierError(
        f"cannot open the disk tier's LMDB database at {path}: {why}. The files are damaged "
        f"or not an LMDB database; move the directory aside (e.g. mv {path} {path}.broken) "
        "and restart to begin with an empty disk tier"
    )


def check_data_file(env: lmdb.Environment, path: str) -> None:
    """Raise ``damaged`` unless data.mdb holds LMDB's trees intact enough to be read.

    Call it before anything reads a page. LMDB maps the file and trusts what it
    finds: a page past the end of the file is SIGBUS, and a B-tree page that is
    zeroed (a crash on a filesystem that had not written it yet) or overwritten
    fails an assertion inside LMDB, which aborts the process. Either would kill the
    server at every start. So: the file must reach LMDB's last used page
    (``mm_last_pg`` of the newest meta page), and every branch and leaf page of the
    free list, the main tree and the sub-databases must carry its own page number
    and a sane header (``_walk``). Values are not read (records are verified on
    every read). A meta page that is itself damaged is refused by ``lmdb.open``.
    """
    data = os.path.join(path, DATA_FILE)
    info, psize = env.info(), env.stat()["psize"]
    last = info["last_pgno"]
    need = (last + 1) * psize
    try:
        fd = os.open(data, os.O_RDONLY)
    except OSError as e:
        raise damaged(path, e) from e
    try:
        size = os.fstat(fd).st_size
        if size < need:
            raise damaged(
                path,
                f"{data} is truncated: it is {size} bytes, and LMDB's last used page "
                f"(page {last}) ends at byte {need}",
            )
        why = _walk(fd, psize, last, info["last_txnid"])
    finally:
        os.close(fd)
    if why:
        raise damaged(path, f"{data}: {why}")


# LMDB 0.9's layout on 64-bit hosts (mdb.c): a page header, a meta page's MDB_meta,
# an MDB_db (a tree's root and counts), a node header. Little-endian, as written.
_PAGE_HDR = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_MDB_DB = struct.Struct("<IHHQQQQQ")  # md_pad, flags, depth, 3 page counts, entries, md_root
_NODE_HDR = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_META_AT, _META_MAGIC = _PAGE_HDR.size, 0xBEEFC0DE  # MDB_meta follows the page header
_DBS_AT = _META_AT + 24  # after mm_magic, mm_version, mm_address, mm_mapsize
_TXNID_AT = _DBS_AT + 2 * _MDB_DB.size + 8  # after mm_dbs[2], mm_last_pg
_P_BRANCH, _P_LEAF, _P_LEAF2 = 0x01, 0x02, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_NO_PAGE = 2**64 - 1  # P_INVALID: the root of an empty tree
_MAX_DEPTH = 64


def _walk(fd: int, psize: int, last: int, txnid: int) -> str | None:
    """Why LMDB's trees in ``fd`` are not safe to read, or None. Reads each branch and
    leaf page once (the meta tree's leaves are read again by the index rebuild)."""
    for meta_pgno in (0, 1):  # the meta page LMDB chose is the one with the newest txn
        meta = os.pread(fd, psize, meta_pgno * psize)
        if len(meta) < _TXNID_AT + 8:
            return f"meta page {meta_pgno} is short"
        magic = int.from_bytes(meta[_META_AT : _META_AT + 4], "little")
        if (
            magic == _META_MAGIC
            and int.from_bytes(meta[_TXNID_AT : _TXNID_AT + 8], "little") == txnid
        ):
            break
    else:
        return f"no meta page holds transaction {txnid}, the one LMDB opened"
    roots = [_MDB_DB.unpack_from(meta, _DBS_AT + i * _MDB_DB.size)[7] for i in (0, 1)]
    seen: set[int] = set()
    # (page, depth, is a leaf of the main tree: its F_SUBDATA nodes are sub-databases)
    todo = [(root, 1, i == 1) for i, root in enumerate(roots) if root != _NO_PAGE]
    while todo:
        pgno, depth, main = todo.pop()
        if not 2 <= pgno <= last or pgno in seen or depth > _MAX_DEPTH:
            return f"a tree points at page {pgno} (pages 2..{last} exist; a cycle or worse)"
        seen.add(pgno)
        page = os.pread(fd, psize, pgno * psize)
        own, _, flags, lower, upper = _PAGE_HDR.unpack_from(page)
        kind = flags & (_P_BRANCH | _P_LEAF)
        if own != pgno or kind not in (_P_BRANCH, _P_LEAF):
            return f"page {pgno} is zeroed or overwritten (it says page {own}, flags {flags:#x})"
        if not _PAGE_HDR.size <= lower <= upper <= psize or (lower - _PAGE_HDR.size) % 2:
            return f"page {pgno} has a damaged header (lower {lower}, upper {upper})"
        if flags & _P_LEAF2:
            continue  # fixed-size keys, no nodes (kvstore's trees have none)
        for i in range((lower - _PAGE_HDR.size) // 2):
            at = int.from_bytes(page[_PAGE_HDR.size + 2 * i : _PAGE_HDR.size + 2 * i + 2], "little")
            if not upper <= at <= psize - _NODE_HDR.size:
                return f"page {pgno} has a node outside the page"
            lo, hi, nflags, ksize = _NODE_HDR.unpack_from(page, at)
            body = at + _NODE_HDR.size + ksize
            if kind == _P_BRANCH:
                todo.append((lo | hi << 16 | nflags << 32, depth + 1, main))
            elif nflags & _F_SUBDATA and main:
                if body + _MDB_DB.size > psize:
                    return f"page {pgno} has a damaged sub-database entry"
                root = _MDB_DB.unpack_from(page, body)[7]
                if root != _NO_PAGE:
                    todo.append((root, 1, False))
            elif body + (8 if nflags & _F_BIGDATA else lo | hi << 16) > psize:
                return f"page {pgno} has a node running past the page"
    return None


# -- meta entries and records -------------------------------------------------------


@dataclass(slots=True)
class Entry:
    size: int  # stored record bytes
    fingerprint: bytes
    pinned: bool
    last_ms: int
    hits: int
    seq: int


def pack_meta(e: Entry, header_bytes: bytes | memoryview) -> bytes:
    fixed = _META.pack(
        _META_VERSION, _PINNED if e.pinned else 0, e.hits & 0xFFFFFFFF, e.size, e.last_ms, e.seq
    )
    h = xxhash.xxh3_64(fixed)
    h.update(header_bytes)
    return fixed + _META_CHECK.pack(h.intdigest()) + bytes(header_bytes)


def parse_meta(key: bytes, value: bytes | memoryview) -> tuple[Entry, RecordHeader]:
    """Raises CorruptRecord if the entry is damaged or does not describe ``key``."""
    view = memoryview(value)
    if len(view) < META_FIXED:
        raise CorruptRecord("meta entry is too short")
    version, flags, hits, size, last_ms, seq = _META.unpack_from(view)
    (check,) = _META_CHECK.unpack_from(view, _META.size)
    h = xxhash.xxh3_64(view[: _META.size])
    h.update(view[META_FIXED:])
    if version != _META_VERSION or h.intdigest() != check:
        raise CorruptRecord("meta entry checksum or version mismatch")
    header = parse_header(view[META_FIXED:], expect_key=key)
    if size != header.record_size:
        raise CorruptRecord(f"meta says {size} bytes, the header {header.record_size}")
    return Entry(size, header.fingerprint, bool(flags & _PINNED), last_ms, hits, seq), header


def is_disk_full(e: BaseException, path: str, need: int) -> bool:
    code = getattr(e, "errno", None) if isinstance(e, OSError) else getattr(e, "code", None)
    if isinstance(e, lmdb.DiskError) or code in _DISK_FULL:
        return True
    # LMDB reports a short write (the disk filled up part way through) as EIO.
    if code == errno.EIO:
        with contextlib.suppress(OSError):
            st = os.statvfs(path)
            return st.f_bavail * st.f_frsize < need + 64 * MiB
    return False


def in_place(key: bytes, view: memoryview) -> tuple[RecordHeader, memoryview]:
    """A record read in place: its header (checked, and its length against the view) and
    its stored payload, still unverified. Raises CorruptRecord."""
    header = parse_header(view, expect_key=key)
    hs = header.header_size
    if len(view) != hs + header.stored_size:
        raise CorruptRecord(f"record is {len(view)} bytes, its header says {header.record_size}")
    return header, view[hs:]


def copy_out(key: bytes, view: memoryview, out: memoryview | None) -> bytes | RecordHeader:
    """Verify a record read in place and copy it out: the whole record as bytes, or
    (with ``out``) the raw payload into ``out``. Raises CorruptRecord."""
    if out is None:
        verify(view, expect_key=key)
        return bytes(view)
    header, stored = in_place(key, view)
    if header.codec is not Codec.RAW:
        if xxhash.xxh3_64_intdigest(stored) != header.payload_checksum:
            raise CorruptRecord("payload checksum mismatch")
        copy_into(out, decode_payload(header, stored), header.raw_size)
        return header
    n = header.raw_size  # = stored_size for RAW (parse_header does not check it: we do below)
    if out.nbytes < n:
        raise InvalidArgument(f"output buffer holds {out.nbytes} bytes, the payload is {n}")
    if len(stored) != n:
        raise CorruptRecord(f"raw payload is {len(stored)} bytes, its header says {n}")
    # One verified copy (accel.copy_xxh3: one pass over the bytes with the native
    # module): a record that fails leaves garbage in ``out``, and is a miss.
    dst = out if out.ndim == 1 and out.format == "B" else out.cast("B")
    if accel.copy_xxh3(dst[:n], stored) != header.payload_checksum:
        raise CorruptRecord("payload checksum mismatch")
    return header


# -- opening ------------------------------------------------------------------
def open_env(
    path: str, map_size: int, sync: bool
) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database]:
    """LMDB's environment in ``path`` and its two sub-databases, ``records`` and ``meta``;
    ``sync``: every commit is synced to disk (durability "fsync")."""
    try:
        env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=2,
            subdir=True,
            sync=sync,
            metasync=sync,
            writemap=False,
            max_readers=512,
            mode=0o600,  # data.mdb and lock.mdb, when made: the server's user only
        )
    except lmdb.Error as e:  # a damaged meta page (zeroed, or not LMDB's)
        raise damaged(path, e) from e
    try:
        check_data_file(env, path)  # before the first page is read
        records = env.open_db(b"records")
        meta = env.open_db(b"meta")
        env.reader_check()  # reader slots left by a killed process pin old pages
    except BaseException as e:
        env.close()
        if isinstance(e, lmdb.Error):
            raise damaged(path, e) from e
        raise
    return env, records, meta


def read_index(
    env: lmdb.Environment, records: lmdb._Database, meta: lmdb._Database, path: str
) -> tuple[list[tuple[bytes, Entry]], list[bytes]]:
    """The index from ``meta`` alone, least recently used first, and the keys to delete:
    meta entries that do not verify, and records that have none."""
    entries: list[tuple[bytes, Entry]] = []
    broken: list[bytes] = []
    try:
        with env.begin(db=meta, buffers=True) as txn:
            for k, v in txn.cursor():
                key = bytes(k)
                try:
                    entry, _ = parse_meta(key, v)
                except CorruptRecord as e:
                    log.warning("disk tier %s: dropping damaged meta of %s: %s", path, key.hex(), e)
                    broken.append(key)
                    continue
                entries.append((key, entry))
            # Both tables change in one transaction, so their counts agree unless a
            # meta entry was dropped above or the files were edited by hand.
            if txn.stat(records)["entries"] != len(entries):
                known = {k for k, _ in entries}.union(broken)
                broken += [
                    bytes(k)
                    for k in txn.cursor(records).iternext(values=False)
                    if bytes(k) not in known
                ]
    except lmdb.Error as e:
        raise TierError(
            f"cannot read the disk tier index at {path}: {e}; move the "
            "directory aside and restart to begin with an empty disk tier"
        ) from e
    entries.sort(key=lambda kv: kv[1].seq)
    return entries, broken
