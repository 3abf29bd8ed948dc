"""The store's read path: leases and reads served from L1, the tiers below read at most
once and what they hold promoted into L1, lookups, and prefetch (promotion ahead of
the reads).

A mixin of ``kvstore.engine.store.TieredStore`` (``ReadPath``), split out so that neither
module grows past what one sitting reads; it works on the store's tiers, index and
locks, declared below for the type checker, under the lock order of the store's
docstring. A read that misses L1 takes one decision (``kvstore.engine.fallback``): the tier
below is read once, L1 offered the record once, and if L1 cannot take it now the
record is kept a moment for the follow-up read.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

from kvstore.clock import Clock
from kvstore.config import StoreConfig
from kvstore.engine.fallback import Fallbacks
from kvstore.engine.index import Entry, Index, layout_of, tier_levels
from kvstore.engine.lookup import KeyChain, RemoteView, lookup
from kvstore.engine.tiers.base import Tier, copy_into
from kvstore.engine.tiers.disk_loans import LOAN_BIT, Lender, Lent, Loans
from kvstore.engine.tiers.memory import MemoryTier, ReadLease
from kvstore.engine.writer import Prefetcher, WriteDown
from kvstore.errors import CorruptRecord
from kvstore.keys import ChunkKey, Fingerprint
from kvstore.records import Codec, RecordHeader, header_size, parse_header, transcode_parts
from kvstore.types import LookupResult, PutStatus, TierLevel


class ReadPath:
    if TYPE_CHECKING:  # the store's state this works on (TieredStore sets it up)
        memory: MemoryTier
        disk: Tier | None
        remote: Tier | None
        index: Index
        config: StoreConfig
        _lock: threading.RLock
        _clock: Clock
        _closed: bool
        _fallbacks: Fallbacks
        _writer: WriteDown
        _prefetcher: Prefetcher
        _layouts: dict[Fingerprint, tuple[str, int, int]]
        _counters: dict[str, int]

        def _check_open(self) -> None: ...
        def _count(self, name: str, n: int = 1) -> None: ...
        def _lower(self, level: int) -> list[Tier]: ...
        def _touch(self, key: ChunkKey) -> None: ...
        def _begin(self, key: ChunkKey) -> None: ...
        def _end(self, key: ChunkKey) -> bool: ...
        def _drop_due(self) -> int: ...
        def _loans(self) -> Loans | None: ...

    def acquire(
        self, key: ChunkKey, owner: str = "", *, payload: bool = True, lasting: bool = False
    ) -> ReadLease | None:
        """A read lease on the chunk in L1, promoting it from below if needed.

        ``payload=False``: the holder verifies the payload itself; ``lasting``: the lease
        never expires, the holder releases it (``MemoryTier.acquire``).
        """
        self._check_open()
        self._count("gets")
        lease = self.memory.acquire(key, owner=owner, payload=payload, lasting=lasting)
        return self._acquired(key, lease, owner, payload, lasting)

    def _acquired(
        self, key: ChunkKey, lease: ReadLease | None, owner: str, payload: bool, lasting: bool
    ) -> ReadLease | None:
        """``acquire`` after L1 answered ``lease``: promoted from below on a miss."""
        if lease is None and self._fallbacks.refused(key):
            return None  # L1 could not take it a moment ago: its record is kept for read()
        if lease is None and self._promote_below(key):
            # Promoted: L1 counted the miss, the tier below the hit.
            lease = self.memory.acquire(
                key, owner=owner, payload=payload, lasting=lasting, internal=True
            )
        if lease is not None:
            self._count("hits")
            self._touch(key)
        return lease

    def lend(
        self,
        keys: Sequence[ChunkKey],
        owner: str = "",
        *,
        promote: bool = True,
        disk: bool = True,
    ) -> list[ReadLease | Lent | None]:
        """For each key a lease on the chunk in L1, or else its record lent where it lies
        in L2's file (``DiskTier.lend``: one read transaction for them all, no
        promotion), or else a lease after a promotion from below (L3, or a record L2
        holds encoded), or None. For a reader on this host that maps L2's data file and
        verifies every payload as it copies it: only headers are checked here.
        ``promote=False`` (a lookup lending what it found): nothing is read from below,
        so a chunk neither in L1 nor lendable in place is None; ``disk=False`` (a reader
        that does not map L2's file): nothing is lent in place either."""
        self._check_open()
        self._count("gets", len(keys))
        out: list[ReadLease | Lent | None] = [
            self.memory.acquire(key, owner=owner, payload=False) for key in keys
        ]
        l2, lender = self.disk, self.lender
        missed = [i for i, got in enumerate(out) if got is None]
        try:
            if disk and l2 is not None and lender is not None and missed:
                here = [i for i in missed if self._may_hold(l2, self.index.get(keys[i]))]
                for i, lent in zip(here, lender.lend([keys[i] for i in here], owner), strict=True):
                    out[i] = lent
            for i, got in enumerate(out):
                if got is None:
                    if promote:
                        out[i] = self._acquired(keys[i], None, owner, False, False)
                else:
                    self._count("hits")
                    self._touch(keys[i])
        except BaseException:
            for got in out:  # all or nothing: a failed call leaves nothing held
                if got is not None:
                    self.release(got.id)
            raise
        return out

    @cached_property
    def lender(self) -> Lender | None:
        """L2, if it lends records where they lie in its file (LMDB does). Looked at once:
        a store's tiers are fixed, and a runtime-checkable protocol's ``isinstance`` costs
        ~10 us, paid on every loan's release before."""
        return self.disk if isinstance(self.disk, Lender) else None

    def read(
        self, key: ChunkKey, owner: str = "", *, lasting: bool = False
    ) -> ReadLease | bytes | None:
        """A lease on the chunk in L1 or, when L1 cannot take it now, its raw record; None
        on a miss. One decision: the tier below is read at most once, L1 offered it at
        most once, and a record an ``acquire`` just read for nothing is served from memory
        (the Get stream a client falls back to after an Acquire answered ``use_get``)."""
        self._check_open()
        self._count("gets")
        lease = self.memory.acquire(key, owner=owner, lasting=lasting)
        if lease is None:
            blob = self._fallbacks.take(key)
            if blob is None:
                blob, promoted = self._read_below(key)
                if blob is None:
                    return None
                if promoted:
                    lease = self.memory.acquire(key, owner=owner, lasting=lasting, internal=True)
            if lease is None:
                self._count("hits")
                self._touch(key)
                return blob
        self._count("hits")
        self._touch(key)
        return lease

    def release(self, lease_id: int) -> bool:
        """End an L1 lease or an L2 loan; False if it was not held or had expired."""
        if lease_id & LOAN_BIT:
            return (loans := self._loans()) is not None and loans.release(lease_id)
        released = self.memory.release(lease_id)
        self._drop_due()  # a dropped chunk this lease was the last hold on goes now
        return released

    # -- reads ----------------------------------------------------------------
    def get(self, key: ChunkKey, *, count: bool = True) -> bytes | None:
        """The whole raw record of a chunk (header + raw payload), or None."""
        self._check_open()
        if count:
            self._count("gets")
        in_l1 = self._may_hold(self.memory, self.index.get(key))
        blob = self.memory.get(key) if in_l1 else None
        if blob is None:
            blob = self._fallbacks.take(key) or self._read_below(key)[0]
        if blob is not None:
            if count:
                self._count("hits")
            self._touch(key)
        return blob

    def _promote_below(self, key: ChunkKey) -> bool:
        """Whether L1 now holds the chunk, promoted from below if it was there.

        From L2 the payload is copied once, straight from LMDB's map into L1's pages and
        verified as it lands (``DiskTier.read_with``): a promotion is one pass over the
        bytes, not a verify, a copy out and a copy in (a quarter less time at 2 MiB).
        """
        disk = self.disk
        skip: Tier | None = None
        if disk is not None and self._may_hold(disk, self.index.get(key)):
            promoted = disk.read_with(key, self._promote_in_place)
            if promoted is not None:
                return promoted
            skip = disk  # a miss there (evicted, or damaged and deleted): ask the rest once
        return self._read_below(key, skip=skip)[1]

    def _promote_in_place(self, header: RecordHeader, stored: memoryview) -> bool:
        if self._promote(header, stored, verify=True):
            return True
        # L1 refused it: a verified copy is kept for the read that follows, as
        # _read_below keeps what it read (the Get after an Acquire's use_get).
        if xxhash.xxh3_64_intdigest(stored) != header.payload_checksum:
            raise CorruptRecord("payload checksum mismatch")
        self._fallbacks.keep(header.key, self._raw(header, header.pack() + bytes(stored)))
        return False

    def _read_below(self, key: ChunkKey, skip: Tier | None = None) -> tuple[bytes | None, bool]:
        """The raw record from the first tier below L1 that has it (but ``skip``), offered
        to L1 once (kept for the next read if L1 cannot take it), or a pending move's
        bytes; and whether L1 now holds it."""
        entry = self.index.get(key)
        for tier in self._lower(self.memory.level):
            if tier is skip or not self._may_hold(tier, entry):
                continue
            blob = tier.get(key)
            if blob is None:
                continue
            header = parse_header(blob)
            if header.codec != Codec.RAW:
                blob = transcode_parts(header, memoryview(blob)[header.header_size :], Codec.RAW)
                header = parse_header(blob)
            if tier is self.remote and entry is None:
                with self._lock:  # learned from the shared tier: index it
                    entry = self.index.add(header, tier.level)
                    self._layouts.setdefault(header.fingerprint, layout_of(header))
            promoted = self._promote(header, memoryview(blob)[header.header_size :])
            if not promoted:
                self._fallbacks.keep(key, blob)
            return blob, promoted
        pending = self._writer.pending_move(key)
        if pending is not None:
            return self._raw(*pending), False
        return None, False

    def get_into(self, key: ChunkKey, out: memoryview) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out``; its header, or None on a miss."""
        self._check_open()
        try:
            header = self.memory.get_into(key, out)
        except BaseException:
            self._count("gets")
            raise
        if header is not None:  # an L1 hit: both counters in one trip through the lock
            with self._lock:
                self._counters["gets"] += 1
                self._counters["hits"] += 1
        else:
            self._count("gets")
            blob = self._fallbacks.take(key) or self._read_below(key)[0]
            if blob is None:
                return None
            header = parse_header(blob)
            copy_into(out, memoryview(blob)[header.header_size :], header.raw_size)
            self._count("hits")
        self._touch(key)
        return header

    def _raw(self, header: RecordHeader, blob: bytes) -> bytes:
        if header.codec == Codec.RAW:
            return blob
        return transcode_parts(header, memoryview(blob)[header.header_size :], Codec.RAW)

    def _may_hold(self, tier: Tier, entry: Entry | None) -> bool:
        if entry is not None and entry.tiers & (1 << tier.level):
            return True
        # The local index is authoritative for local tiers; the remote is shared.
        return tier is self.remote

    def _promote(self, header: RecordHeader, payload: memoryview, verify: bool = False) -> bool:
        """Offer a record read from below to L1; False if L1 refused it (remembered).
        ``verify``: the payload is not verified yet (``_promote_below``): L1 checks it as
        it copies it (CorruptRecord)."""
        if self._fallbacks.refused(header.key):
            return False
        self._begin(header.key)
        try:
            status = self.memory.put(header, payload, verify=verify)
        finally:
            evicted = self._end(header.key)
        if status in (PutStatus.FULL, PutStatus.TOO_LARGE):
            self._fallbacks.refuse(header.key)
            return False
        if status == PutStatus.STORED and not evicted:
            with self._lock:
                if header.key in self.index:  # not deleted meanwhile
                    self.index.add(header, self.memory.level)
        return True

    # -- where chunks are: contains and lookup ---------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty when none)."""
        out: list[tuple[int, ...]] = []
        unknown: list[int] = []
        for i, key in enumerate(keys):
            entry = self.index.get(key)
            out.append(tuple(tier_levels(entry.tiers)) if entry else ())
            if entry is None or not entry.tiers & (1 << TierLevel.REMOTE):
                unknown.append(i)
        if self.remote is not None and unknown:
            present = self.remote.contains([keys[i] for i in unknown])
            for i, here in zip(unknown, present, strict=True):
                if here and 3 not in out[i]:
                    out[i] = (*out[i], 3)
        return out

    def lookup(
        self,
        fingerprint: Fingerprint,
        tokens: Sequence[int] | np.ndarray,
        *,
        min_tokens: int = 0,
        granularity: int | None = None,
        count: bool = True,
        local: bool = False,
    ) -> LookupResult:
        """The longest stored prefix of ``tokens`` in this namespace (kvstore.engine.lookup).

        ``count=False``: a repeat of a lookup already counted (Stats count a request once);
        ``local``: only what this host's tiers hold (no round trip to the remote).
        """
        self._check_open()
        remote = None if local else self._remote_view()
        result = lookup(
            self.index,
            fingerprint,
            tokens,
            chunk_tokens=self.config.chunk_tokens,
            granularity=granularity,
            min_tokens=min_tokens,
            remote=remote,
        )
        self._count_lookup(result, count)
        return result

    def _remote_view(self) -> RemoteView | None:
        """The shared tier as lookups ask it (partial matches too), if there is one."""
        remote = self.remote
        return cast(RemoteView, remote) if hasattr(remote, "siblings") else None

    def lookup_keys(
        self,
        fingerprint: Fingerprint,
        keys: bytes,
        n_tokens: int,
        sub_hashes: bytes = b"",
        *,
        sub_hashes_of: int | None = None,
        min_tokens: int = 0,
        granularity: int | None = None,
        count: bool = True,
    ) -> tuple[LookupResult, int | None]:
        """``lookup`` of a prompt given as its chunk keys (``keys.chunk_keys``, 32 bytes
        each, of an ``n_tokens`` prompt) and each chunk's ``keys.sub_hashes`` at this
        store's granularity, concatenated, or only chunk ``sub_hashes_of``'s (empty: none),
        as a client hashes them instead of sending the token ids: the same walk and rules
        (``kvstore.engine.lookup.KeyChain``). Also the chunk whose sub-hashes the partial match
        needed and did not get (the answer then counts whole chunks, and is not counted
        in the stats: the caller asks again), or None."""
        self._check_open()
        cfg = self.config
        chain = KeyChain(
            keys, n_tokens, sub_hashes, cfg.chunk_tokens, cfg.granularity, sub_hashes_of
        )
        remote = self._remote_view()
        result = lookup(
            self.index,
            fingerprint,
            chain,
            chunk_tokens=cfg.chunk_tokens,
            granularity=granularity,
            min_tokens=min_tokens,
            remote=remote,
        )
        self._count_lookup(result, count and chain.needs is None)
        return result, chain.needs

    def _count_lookup(self, result: LookupResult, count: bool) -> None:
        if count:
            self._add_lookups(1, result.total_tokens, result.matched_tokens)

    def _add_lookups(self, lookups: int, tokens: int, matched: int) -> None:
        """The one count of lookups in Stats: those asked here, and those a client answered
        by the presence filter (``count_lookups``)."""
        with self._lock:
            self._counters["lookups"] += lookups
            self._counters["lookup_tokens"] += tokens
            self._counters["matched_tokens"] += matched

    # -- prefetch: promotion ahead of the reads --------------------------------
    def prefetch(
        self, fingerprint: Fingerprint, keys: Sequence[ChunkKey], *, skip_disk: bool = False
    ) -> int:
        """Start promoting these chunks of namespace ``fingerprint`` into L1 where they
        are only below it (L2, L3), in the background: an ``acquire`` soon after finds
        them in L1. How many were queued. Never waits: chunks in L1 already, or being
        promoted, are skipped, and past the prefetcher's byte budget (bytes queued or
        running) the rest are left to the reads. A chunk L1 refuses (full of pinned or
        leased pages) is offered once (``kvstore.engine.fallback``): not again while that
        refusal stands, and its record is kept for the read that follows.

        ``skip_disk``: chunks L2 holds stay there (a reader that ``lend`` serves from
        L2's file in place); only those below it are promoted."""
        self._check_open()
        l1 = 1 << self.memory.level
        keep = l1 | (1 << self.disk.level if skip_disk and self.disk is not None else 0)
        items: list[tuple[ChunkKey, int]] = []
        for key in keys:
            entry = self.index.get(key)
            if entry is not None:
                if not entry.tiers & keep:
                    items.append((key, entry.record_size))
            elif self.remote is not None:  # only the shared tier knows it
                items.append((key, self._record_estimate(fingerprint)))
        return self._prefetcher.submit(items) if items else 0

    def _record_estimate(self, fingerprint: Fingerprint) -> int:
        """The bytes of a whole chunk of this namespace, for one the index does not know."""
        ct = self.config.chunk_tokens
        known = self._layouts.get(fingerprint)
        return header_size(ct) + (known[1] * ct // known[2] if known else 1 << 20)

    def _prefetch_one(self, key: ChunkKey) -> None:
        """One promotion of the prefetcher: read from below once, offered to L1 once."""
        if self._closed:
            return
        entry = self.index.get(key)
        if entry is not None and entry.tiers & (1 << self.memory.level):
            return  # a read promoted it meanwhile
        if self._fallbacks.refused(key):
            return  # L1 refused it a moment ago: not offered again (no loop)
        self._promote_below(key)
