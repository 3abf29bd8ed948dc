"""L1's read path: every read of the arena checks what it delivers.

A mixin of ``kvstore.engine.tiers.memory.MemoryTier`` (``L1Reads``), split out as the
store's read path is (``store_reads``), so that neither module grows past what one sitting
reads; it works on the tier's index, arena, holds and lock, declared below for the type
checker. The verification policy is the tier's (its module docstring): reads (``get``,
``get_into``, ``acquire``, the write-down's reads) hash the payload when
``verify_reads``; a record that fails is deleted, counted once in ``stats().corrupt``,
reported, and a miss.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvstore.arena import ArenaView, Extent, as_u8
from kvstore.clock import wall_ms
from kvstore.engine.tiers.base import ChunkInfo
from kvstore.engine.tiers.holds import HoldTable
from kvstore.engine.tiers.pages import ReadLease
from kvstore.errors import InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader
from kvstore.types import TierStats

log = logging.getLogger("kvstore.engine.tiers.memory")


@dataclass(eq=False, slots=True)
class Entry:
    """One record in the arena: where its pages are, and who holds it."""

    header: RecordHeader
    packed: bytes  # the header as written to the arena
    pages: list[Extent]  # allocator runs; [] once freed
    extents: tuple[Extent, ...]
    hs: int  # header bytes (the payload starts here); cached: hot paths read it often
    size: int  # record bytes
    pinned: bool = False
    refs: int = 0  # read leases + in-process reads: the pages must not move
    deleted: bool = False  # out of the index; pages go back when refs reaches 0
    drop: bool = False  # a consumer dropped it while others held it: due when refs reaches 0
    # found damaged: counted and reported once, however many readers find it at once
    damaged: bool = False
    hits: int = 0
    last_access_ms: int = 0

    @property
    def n_pages(self) -> int:
        return sum(n for _, n in self.pages)


class L1State:
    """What ``MemoryTier``'s mixins (``L1Reads``, ``memory_holds.L1Holds``) work on, declared
    once for the type checker; ``MemoryTier`` sets it up. Nothing at run time."""

    if TYPE_CHECKING:
        _lock: threading.Lock
        _chunks: OrderedDict[ChunkKey, Entry]
        _holds: HoldTable[Entry]
        _arena: ArenaView
        _verify: bool
        _stats: TierStats

        def _check_open(self) -> None: ...
        def _unref_locked(self, entry: Entry) -> None: ...


class L1Reads(L1State):
    if TYPE_CHECKING:  # the rest of the tier's state this works on
        _internal_reads: int
        _internal_bytes: int

        def _report_corrupt(self, key: ChunkKey) -> None: ...
        def _unindex(self, entry: Entry) -> None: ...

    def _ref(self, key: ChunkKey, internal: bool = False) -> Entry | None:
        with self._lock:
            self._check_open()
            entry = self._chunks.get(key)
            if entry is None:
                if not internal:
                    self._stats.misses += 1
                return None
            entry.refs += 1
            if not internal:
                self._chunks.move_to_end(key)
            return entry

    def _hit_locked(self, entry: Entry) -> None:
        entry.hits += 1
        entry.last_access_ms = wall_ms()
        self._stats.hits += 1
        self._stats.bytes_out += entry.size

    def _mark_damaged(self, entry: Entry) -> bool:
        """Whether this is the first finding of the entry's damage (the one to count)."""
        with self._lock:
            first, entry.damaged = not entry.damaged, True
            return first

    def _drop_corrupt(self, entry: Entry) -> None:
        first = self._mark_damaged(entry)
        with self._lock:
            self._stats.corrupt += first
            self._stats.misses += 1
            if self._chunks.get(entry.header.key) is entry:
                self._unindex(entry)
            self._unref_locked(entry)
        if first:
            log.warning("L1 chunk %s failed verification; deleted", entry.header.key.hex())
            self._report_corrupt(entry.header.key)

    def _header_ok(self, entry: Entry) -> bool:
        """The header bytes in the arena are the ones we wrote."""
        return self._arena.equals(entry.extents, 0, entry.packed)

    def _in_place_ok(self, entry: Entry) -> bool:
        """The header bytes are the ones we wrote and the payload hashes right, read in place."""
        return self._header_ok(entry) and self._payload_ok(entry)

    def _payload_ok(self, entry: Entry) -> bool:
        want = entry.header.payload_checksum
        return self._arena.checksum(entry.extents, entry.hs, entry.header.stored_size) == want

    def _blob_ok(self, entry: Entry, blob: bytes) -> bool:
        hs, want = entry.hs, entry.header.payload_checksum
        view = memoryview(blob)  # slicing bytes would copy the payload
        return view[:hs] == entry.packed and xxhash.xxh3_64_intdigest(view[hs:]) == want

    def _counted_locked(self, entry: Entry, internal: bool) -> None:
        if internal:  # the store's own read (a write-down, a promotion): apart from clients'
            self._internal_reads += 1
            self._internal_bytes += entry.size
        else:
            self._hit_locked(entry)

    def _read(
        self, key: ChunkKey, copy: Callable[[Entry], bool], internal: bool = False
    ) -> Entry | None:
        """Run ``copy`` (False: the bytes did not verify) while a ref keeps the pages put."""
        entry = self._ref(key, internal)
        if entry is None:
            return None
        try:
            ok = copy(entry)
        except BaseException:
            with self._lock:
                self._unref_locked(entry)
            raise
        if not ok:
            self._drop_corrupt(entry)
            return None
        with self._lock:
            self._counted_locked(entry, internal)
            self._unref_locked(entry)
        return entry

    def get(self, key: ChunkKey, *, internal: bool = False) -> bytes | None:
        """``internal``: the store's own read (a write-down's copy), counted apart from
        client reads (``detail.internal_reads``), no hit, miss or LRU touch."""
        blobs: list[bytes] = []

        def copy(e: Entry) -> bool:
            blobs.append(self._arena.read(e.extents, 0, e.size))
            return not self._verify or self._blob_ok(e, blobs[0])

        return blobs[0] if self._read(key, copy, internal) else None

    def get_into(self, key: ChunkKey, out: memoryview) -> RecordHeader | None:
        """Copy the payload straight from the extents into ``out``.

        Verification hashes the bytes as they are copied (one pass with the native
        module): that checks exactly the bytes delivered (if they do not verify,
        ``out`` holds garbage and this is a miss).
        ``_ref``/``_read`` inlined, no closure: at 1 MiB the copy and hash take ~40 us
        and each microsecond of bookkeeping around them is ~1.5% of the call.
        """
        dst = as_u8(out, writable=True)
        with self._lock:  # _ref, inlined
            self._check_open()
            entry = self._chunks.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            entry.refs += 1  # the pages stay put while we copy
            self._chunks.move_to_end(key)
        header = entry.header
        try:
            n = header.stored_size
            if dst.size != n:
                if dst.size < n:
                    raise InvalidArgument(
                        f"output buffer holds {dst.size} bytes, the payload is {n}"
                    )
                dst = dst[:n]
            arena = self._arena
            if not self._verify:
                arena.read_into(entry.extents, entry.hs, dst)
                ok = True
            elif arena.equals(entry.extents, 0, entry.packed):
                ok = arena.read_into_hashed(entry.extents, entry.hs, dst) == header.payload_checksum
            else:
                ok = False
        except BaseException:
            with self._lock:
                self._unref_locked(entry)
            raise
        if not ok:
            self._drop_corrupt(entry)
            return None
        with self._lock:
            self._hit_locked(entry)
            self._unref_locked(entry)
        return header

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [k in self._chunks for k in keys]

    def scan(self, fingerprint: bytes | None = None) -> Iterator[ChunkInfo]:
        """Chunks in LRU order (least recently used first), as of the call."""
        with self._lock:  # not a generator: a closed tier raises at the call
            self._check_open()
            return iter(
                [
                    ChunkInfo(e.header.key, e.header, e.size, e.pinned, e.last_access_ms, e.hits)
                    for e in self._chunks.values()
                    if fingerprint is None or e.header.fingerprint == fingerprint
                ]
            )

    def acquire(
        self,
        key: ChunkKey,
        *,
        owner: str = "",
        payload: bool = True,
        lasting: bool = False,
        internal: bool = False,
    ) -> ReadLease | None:
        """A read lease on a (verified) chunk, or None on a miss.

        ``lasting``: the lease never expires; only ``release`` ends it (the server's Get
        streams). ``internal``: not a client's read for this tier's counters (the store
        leasing a chunk it just promoted: the tier below counted the hit).

        ``payload=False``: the holder verifies the payload it reads, so only the header
        is checked in place here (a payload pass less on the hot read path).
        """
        entry = self._ref(key, internal)
        if entry is None:
            return None
        if self._verify and not (self._in_place_ok(entry) if payload else self._header_ok(entry)):
            self._drop_corrupt(entry)
            return None
        with self._lock:
            self._counted_locked(entry, internal)
            lid, expires = self._holds.add("lease", entry, owner, lasting=lasting)  # keeps the ref
        return ReadLease(lid, key, entry.header, entry.extents, expires, entry.packed)
