"""Records in L3 as one key or as parts: the layout, and the readers that verify on arrival.

A record whose stored payload is at most ``PART_BYTES`` is one string value,
``c:<key>`` = header + payload (+ MAC trailer), as it always was. A larger one is
stored in parts, because Redis and Valkey move one huge value much slower than
several smaller ones (measured by ``benchmarks/remote_candidates.py``: with
jemalloc a value of 8 MiB or more is a fresh mapping the server faults in on
every request, and its replies go out 64 KiB per event-loop turn; 2 MiB parts,
four in flight, ran 1.5-2x faster for 16-64 MiB values):

    p:{<key>}:<i>   string  bytes [i * PART_BYTES, (i + 1) * PART_BYTES) of the stored payload
    c:<key>         string  the manifest: header + MANIFEST_TAG + u32 part count
                            + u64 part bytes (+ MAC trailer over header and whole payload)

The parts share one hash tag (``{<key>}``), so in a cluster all parts of a record
live on one node and go out in one pipeline. The part names follow from the key
and the header alone, so whoever removes a record (delete, clear, eviction)
removes its parts without reading the manifest.

Atomic for readers. The parts are written first, the manifest last with ``SET
NX``: a reader that finds the manifest finds parts that were complete when it
was written. The reader checks each part's length, then the whole payload's
checksum (and MAC) against the manifest's header, so a part that is missing
(evicted by the server, a writer that died, a delete in between) or torn (a
writer of other bytes for the same key whose claim lapsed while it was still
writing) makes the whole record a miss: deleted, counted in ``detail.torn``,
never served. Writers claim a record before writing its parts and never write
the parts of a stored one (``RemoteBase._store``).

Old readers (before parts existed) see a manifest as a record of the wrong size:
a counted, deleted miss, never wrong bytes. Run one version per prefix.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstore.engine.tiers.remote_guard import TRAILER_BYTES, TRAILER_TAG, ForgedRecord, RecordSeal
from kvstore.engine.tiers.remote_resp import Reader, Sink
from kvstore.errors import CorruptRecord
from kvstore.records import Codec, RecordHeader, parse_header

PART_BYTES = 2 * 1024 * 1024  # payloads larger than this are stored in parts of this size
WINDOW = 4  # parts in flight on one connection
HEAD_GUESS = 4096  # first bytes of a value read to find its header: ~1000 tokens
MANIFEST_TAG = b"KVSPRT01"
_COUNTS = struct.Struct("<IQ")
MANIFEST_BYTES = len(MANIFEST_TAG) + _COUNTS.size
SCRATCH = 1024 * 1024  # bytes of a value that is not wanted, read in pieces of this size


@dataclass(frozen=True)
class Manifest:
    header: RecordHeader
    head: bytes  # the header's bytes as stored (for the MAC)
    count: int
    part_bytes: int
    mac: bytes | None  # the trailer's MAC, without its tag

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each part in the stored payload."""
        return spans(self.header.stored_size, self.part_bytes)


def split(header: RecordHeader) -> bool:
    return header.stored_size > PART_BYTES


def part_count(header: RecordHeader) -> int:
    return -(-header.stored_size // PART_BYTES)


def spans(stored_size: int, step: int = PART_BYTES) -> list[tuple[int, int]]:
    """[start, end) of each part in a stored payload of ``stored_size`` bytes."""
    return [(a, min(stored_size, a + step)) for a in range(0, stored_size, step)]


def part_names(prefix: str, key: bytes, count: int) -> list[str]:
    tag = key.hex()
    return [f"{prefix}:p:{{{tag}}}:{i}" for i in range(count)]


def manifest_value(head: bytes, header: RecordHeader, trailer: bytes | None) -> tuple[bytes, ...]:
    counts = _COUNTS.pack(part_count(header), PART_BYTES)
    return (head, MANIFEST_TAG, counts, *((trailer,) if trailer else ()))


def parse_manifest(value: bytes | bytearray | memoryview, key: bytes) -> Manifest | None:
    """The manifest in a ``c:`` value, or None when the value is a whole record.

    Raises CorruptRecord for a manifest that does not add up."""
    view = memoryview(value)
    header = parse_header(view, expect_key=key)
    hs = header.header_size
    # A manifest is far shorter than its record (it has no payload); anything else is not one.
    if len(view) >= header.record_size or view[hs : hs + len(MANIFEST_TAG)] != MANIFEST_TAG:
        return None
    count, step = _COUNTS.unpack_from(view, hs + len(MANIFEST_TAG))
    rest = view[hs + MANIFEST_BYTES :]
    mac: bytes | None = None
    if len(rest) == TRAILER_BYTES and rest[: len(TRAILER_TAG)] == TRAILER_TAG:
        mac = bytes(rest[len(TRAILER_TAG) :])
    elif len(rest):
        raise CorruptRecord(f"manifest of {len(view)} bytes has {len(rest)} unknown bytes")
    if not step or count != -(-header.stored_size // step):
        raise CorruptRecord(f"manifest says {count} parts of {step} bytes for {header.stored_size}")
    return Manifest(header, bytes(view[:hs]), count, step, mac)


def check(
    header: RecordHeader,
    head: bytes | memoryview,
    payload: memoryview,
    mac: bytes | memoryview | None,
    seal: RecordSeal | None,
) -> CorruptRecord | None:
    """Why a record read in pieces is not to be served, or None when it verifies."""
    if xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
        return CorruptRecord("payload checksum mismatch")
    if seal is not None and not seal.check_parts((head, payload), mac):
        return ForgedRecord("no valid MAC" if mac is not None else "record carries no MAC")
    return None


def skip(reader: Reader, n: int) -> None:
    """Read and drop ``n`` bytes, so the connection stays in step."""
    scratch = memoryview(bytearray(min(n, SCRATCH)))
    while n:
        step = min(n, len(scratch))
        reader.read_into(scratch[:step])
        n -= step


def whole(n: int, reader: Reader) -> bytearray:
    """A sink: the whole value, in one buffer allocated for it."""
    buf = bytearray(n)
    reader.read_into(memoryview(buf))
    return buf


def part_sink(view: memoryview) -> Sink[bool]:
    """A sink for one part: into ``view`` when the lengths agree (True), else dropped."""

    def sink(n: int, reader: Reader) -> bool:
        if n != len(view):
            skip(reader, n)
            return False
        reader.read_into(view)
        return True

    return sink


Landed = RecordHeader | CorruptRecord | bytearray
"""What a read into a buffer gives: the verified header (the payload is in ``out``), why
the record is refused, or the whole value (a manifest, a compressed or small record,
one that does not fit), for the caller to open."""


def into_sink(key: bytes, out: memoryview, seal: RecordSeal | None) -> Sink[Landed]:
    """A sink for ``GET c:<key>``: a raw record's payload straight into ``out``."""

    def sink(n: int, reader: Reader) -> Landed:
        if n <= HEAD_GUESS:
            return whole(n, reader)
        head = bytearray(HEAD_GUESS)
        reader.read_into(memoryview(head))
        try:
            header = parse_header(memoryview(head), expect_key=key)
        except CorruptRecord:
            return _rest(head, n, reader)
        size = header.record_size
        if (
            header.codec != Codec.RAW
            or header.raw_size > out.nbytes
            or size < HEAD_GUESS
            or n not in (size, size + TRAILER_BYTES)
        ):
            return _rest(head, n, reader)
        hs, stored = header.header_size, header.stored_size
        flat = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        flat[: HEAD_GUESS - hs] = memoryview(head)[hs:]
        reader.read_into(flat[HEAD_GUESS - hs : stored])
        trailer = memoryview(bytearray(n - size))
        reader.read_into(trailer)
        mac = None
        if len(trailer):
            if trailer[: len(TRAILER_TAG)] != TRAILER_TAG:
                return CorruptRecord(f"remote value is {n} bytes, its record {size}")
            mac = trailer[len(TRAILER_TAG) :]
        bad = check(header, memoryview(head)[:hs], flat[:stored], mac, seal)
        return header if bad is None else bad

    return sink


def _rest(head: bytearray, n: int, reader: Reader) -> bytearray:
    buf = bytearray(n)
    buf[: len(head)] = head
    reader.read_into(memoryview(buf)[len(head) :])
    return buf
