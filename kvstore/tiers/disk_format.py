"""L2's on-disk formats: the per-chunk meta entry, and reading a record in place.

A meta value (sub-database ``meta``) is the chunk's version, flags, hits, record
size, last access (wall ms) and access sequence, then an xxh3_64 of all of it, then
the record header without its padding: the index is rebuilt from these at open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from dataclasses import dataclass

import lmdb
import xxhash

from kvstore import accel
from kvstore.config import MiB
from kvstore.errors import CorruptRecord, InvalidArgument
from kvstore.records import Codec, RecordHeader, decode_payload, parse_header, verify
from kvstore.tiers.base import copy_into

# meta value: version, flags, hits, record size, last access (wall ms), access seq,
# then an xxh3_64 of everything else, then the record header without its padding.
_META = struct.Struct("<BBxxIQQQ")
_META_CHECK = struct.Struct("<Q")
META_FIXED = _META.size + _META_CHECK.size
_META_VERSION = 1
_PINNED = 1
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


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


def copy_out(key: bytes, view: memoryview, out: memoryview | None) -> bytes | RecordHeader:
    """Verify a record read in place and copy it out: the whole record as bytes, or
    (with ``out``) the raw payload into ``out``. Raises CorruptRecord."""
    if out is None:
        verify(view, expect_key=key)
        return bytes(view)
    header = parse_header(view, expect_key=key)
    hs = header.header_size
    if len(view) != hs + header.stored_size:
        raise CorruptRecord(f"record is {len(view)} bytes, its header says {header.record_size}")
    stored = view[hs:]
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
