"""TieredStore: composes L1 memory, L2 disk and L3 remote behind one API.

- put lands in L1 and is written down asynchronously (write-through), or only
  when evicted (write-back). Whatever the policy, a chunk evicted from a tier
  moves to the next lower tier when that tier exists and lacks it.
- get searches top-down; a hit below L1 is promoted into L1.
- lookup is partial prefix matching over all tiers (kvstore.lookup).
- the store is the only writer of the index. Its lock guards the index only:
  tiers are never called while holding it (tier locks may be held when it is
  taken, by eviction callbacks), which keeps the lock order acyclic.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.arena import ArenaView
from kvstore.clock import Clock, monotonic, wall_ms
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, StoreClosed, TierError
from kvstore.fallback import Fallbacks
from kvstore.index import Entry, Index, tier_levels
from kvstore.keys import ChunkKey, Fingerprint, chunk_key, tokens_to_bytes
from kvstore.lookup import KeyChain, RemoteView, lookup
from kvstore.records import (
    Codec,
    RecordHeader,
    check_put,
    make_header,
    parse_header,
    transcode_parts,
)
from kvstore.tiers.base import Tier, copy_into
from kvstore.tiers.memory import MemoryTier, ReadLease, Reservation
from kvstore.types import ChunkView, LookupResult, PutStatus, StoreStats, TierLevel
from kvstore.writer import Backlog, Job, WriteDown

log = logging.getLogger("kvstore.store")


class TieredStore:
    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        clock: Clock = monotonic,
        memory: MemoryTier | None = None,
        disk: Tier | None = None,
        remote: Tier | None = None,
    ) -> None:
        self.config = cfg = config or StoreConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        self.memory = memory or MemoryTier(cfg.memory, clock=clock)
        try:
            if disk is None and cfg.disk.enabled:
                from kvstore.tiers.disk import DiskTier

                disk = DiskTier(cfg.disk, cfg.data_dir, clock=clock)
            if remote is None and cfg.remote.url:
                from kvstore.tiers.remote import RemoteTier

                remote = RemoteTier(cfg.remote, clock=clock)
        except BaseException:
            for tier in (disk, self.memory):
                if tier is not None:
                    tier.close()
            raise
        self.disk, self.remote = disk, remote
        self.tiers: list[Tier] = [t for t in (self.memory, disk, remote) if t is not None]
        self._by_level = {t.level: t for t in self.tiers}
        self.index = Index(cfg.granularity)
        self._fallbacks = Fallbacks(clock)  # what L1 just refused, decided once per chunk
        self._layouts: dict[Fingerprint, tuple[str, int, int]] = {}  # fp -> dtype, raw, tokens
        self._reservations: dict[int, RecordHeader] = {}
        self._inflight: dict[ChunkKey, int] = {}  # keys between tier put and index update
        self._evicted_inflight: dict[ChunkKey, bool] = {}
        self._counters = {
            "lookups": 0,
            "lookup_tokens": 0,
            "matched_tokens": 0,
            "gets": 0,
            "hits": 0,
            "puts": 0,
            "rejected_puts": 0,
        }
        for tier in self.tiers:
            tier.on_evict = self._evict_callback(tier)
            tier.on_corrupt = self._corrupt_callback(tier)
        self._rebuild()
        self._writer = WriteDown(self._run_job, cfg.write_queue_bytes)
        # Write-through copies the remote did not take (down, or refusing writes), copied
        # again once it takes them (by retry_remote, and after any copy that succeeds):
        # else chunks stored during an outage would never be shared with other hosts.
        self._remote_backlog = Backlog(REMOTE_BACKLOG_KEYS)

    # -- construction ---------------------------------------------------------
    def _rebuild(self) -> None:
        """Refill the index from the persistent local tier (a warm restart)."""
        if self.disk is None:
            return
        n = 0
        for info in self.disk.scan():
            self.index.add(
                info.header,
                self.disk.level,
                pinned=info.pinned,
                last_access_ms=info.last_access_ms,
                hits=info.hits,
            )
            self._layouts.setdefault(info.header.fingerprint, _layout(info.header))
            n += 1
        if n:
            log.info("index rebuilt from %s: %d chunks", self.disk.name, n)

    def _lower(self, level: int) -> list[Tier]:
        return [t for t in self.tiers if t.level > level]

    # -- writes ---------------------------------------------------------------
    def _validate(self, header: RecordHeader) -> None:
        cfg = self.config
        check_put(
            header, max_chunk_bytes=cfg.max_chunk_bytes, chunk_tokens=cfg.chunk_tokens, key=True
        )
        known = self._layouts.get(header.fingerprint)
        dtype, raw, ntok = _layout(header)
        if known is not None:
            if known[0] != dtype:
                raise InvalidArgument(f"namespace holds dtype {known[0]}; this chunk is {dtype}")
            if known[1] * ntok != raw * known[2]:
                raise InvalidArgument(
                    f"namespace holds {known[1] // known[2]} bytes per token; this chunk has "
                    f"{raw / ntok:g} (wrong shape for this namespace?)"
                )

    def put(self, header: RecordHeader, payload: bytes | memoryview) -> PutStatus:
        """Store a chunk (raw payload). EXISTS if the key is already stored anywhere local."""
        self._check_open()
        self._validate(header)
        key = header.key
        if key in self.index:
            return PutStatus.EXISTS
        # Built before the copy: a 1 MiB copy flushes this core's L2, and what runs after
        # it runs from L3 (measured: every step after the copy ~2x slower).
        if self._fallbacks.refused(key):  # L1 refused it a moment ago (a Reserve, say)
            status = self._put_below(header, payload, PutStatus.FULL)
            self._count("puts" if status.ok else "rejected_puts")
            return status
        prepared = self.index.prepare(header, self.memory.level)
        self._begin(key)
        try:
            status = self.memory.put(header, payload)
        except BaseException:
            self._end(key)
            raise
        if status == PutStatus.STORED:  # the common case: one trip through the lock
            with self._lock:
                if not self._end_locked(key):  # else evicted meanwhile: the callback indexed it
                    self._index_locked(header, self.memory.level, prepared)
                self._counters["puts"] += 1
            if self.config.write_policy == "write-through":
                self._writer.submit_copy(key, tuple(t.level for t in self._lower(1)))
            return status
        self._end(key)
        if status in (PutStatus.FULL, PutStatus.TOO_LARGE):
            self._fallbacks.refuse(key)
            status = self._put_below(header, payload, status)
        self._count("puts" if status.ok else "rejected_puts")
        return status

    def put_chunk(
        self,
        fingerprint: Fingerprint,
        parent: ChunkKey,
        tokens: Sequence[int] | np.ndarray,
        payload: bytes | memoryview,
        dtype: str,
        shape: Sequence[int],
    ) -> tuple[ChunkKey, PutStatus]:
        """Convenience: build the record of one chunk and put it."""
        token_bytes = tokens_to_bytes(tokens)
        key = chunk_key(parent, fingerprint, token_bytes)
        header = make_header(
            key=key,
            parent=parent,
            fingerprint=fingerprint,
            token_bytes=token_bytes,
            dtype=dtype,
            shape=shape,
            payload=payload,
        )
        return key, self.put(header, payload)

    def _put_below(
        self, header: RecordHeader, payload: bytes | memoryview, status: PutStatus
    ) -> PutStatus:
        """L1 cannot take it (all pinned/leased, or too large): write straight down."""
        for tier in self._lower(1):
            st = tier.put(header, payload)
            if st.ok:
                with self._lock:
                    self.index.add(header, tier.level)
                    self._layouts.setdefault(header.fingerprint, _layout(header))
                return st
        return status

    def _index_locked(
        self, header: RecordHeader, level: int, prepared: Entry | None = None
    ) -> None:
        self.index.add(header, level, prepared=prepared)
        if header.fingerprint not in self._layouts:
            self._layouts[header.fingerprint] = _layout(header)

    def _committed(self, header: RecordHeader) -> None:
        with self._lock:
            self._index_locked(header, self.memory.level)
        if self.config.write_policy == "write-through":
            self._writer.submit_copy(header.key, tuple(t.level for t in self._lower(1)))

    # -- zero-copy data plane (used by the server for same-host clients) -----
    def reserve(
        self,
        header: RecordHeader,
        owner: str = "",
        *,
        checksum_at_commit: bool = False,
        lasting: bool = False,
    ) -> Reservation | PutStatus:
        """Arena pages for a writer (``MemoryTier.reserve``; ``lasting`` for a writer in
        this process that gives the reservation back itself, however long it takes)."""
        self._check_open()
        self._validate(header)
        if header.key in self.index:
            return PutStatus.EXISTS
        if self._fallbacks.refused(header.key):
            return PutStatus.FULL  # L1 just refused it: the put that follows goes below
        res = self.memory.reserve(
            header, owner=owner, checksum_at_commit=checksum_at_commit, lasting=lasting
        )
        if isinstance(res, Reservation):
            with self._lock:
                self._reservations[res.id] = header
        elif res in (PutStatus.FULL, PutStatus.TOO_LARGE):
            self._fallbacks.refuse(header.key)
        return res

    def commit(self, reservation_id: int, checksum: int | None = None) -> PutStatus:
        """Publish a reservation (``MemoryTier.commit``; ``checksum`` for one made with
        ``checksum_at_commit``)."""
        self._check_open()
        with self._lock:
            header = self._reservations.pop(reservation_id, None)
        if header is not None:
            self._begin(header.key)
        try:
            status = self.memory.commit(reservation_id, checksum)
        finally:
            evicted = header is not None and self._end(header.key)
        if status == PutStatus.STORED and header is not None and not evicted:
            # As sealed: a checksum_at_commit header gets its checksum only at commit.
            self._committed(self.memory.header(header.key) or header)
        self._count("puts" if status.ok else "rejected_puts")
        return status

    def abort(self, reservation_id: int) -> None:
        with self._lock:
            self._reservations.pop(reservation_id, None)
        self.memory.abort(reservation_id)

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
        if lease is None and self._fallbacks.refused(key):
            return None  # L1 could not take it a moment ago: its record is kept for read()
        if lease is None and self._read_below(key)[1]:
            # Promoted: L1 counted the miss, the tier below the hit.
            lease = self.memory.acquire(
                key, owner=owner, payload=payload, lasting=lasting, internal=True
            )
        if lease is not None:
            self._count("hits")
            self._touch(key)
        return lease

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
        return self.memory.release(lease_id)

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

    def _read_below(self, key: ChunkKey) -> tuple[bytes | None, bool]:
        """The raw record from the first tier below L1 that has it, offered to L1 once
        (kept for the next read if L1 cannot take it), or a pending move's bytes; and
        whether L1 now holds it."""
        entry = self.index.get(key)
        for tier in self._lower(self.memory.level):
            if not self._may_hold(tier, entry):
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
                    self._layouts.setdefault(header.fingerprint, _layout(header))
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

    def _promote(self, header: RecordHeader, payload: memoryview) -> bool:
        """Offer a record read from below to L1; False if L1 refused it (remembered)."""
        if self._fallbacks.refused(header.key):
            return False
        self._begin(header.key)
        status = self.memory.put(header, payload)
        evicted = self._end(header.key)
        if status in (PutStatus.FULL, PutStatus.TOO_LARGE):
            self._fallbacks.refuse(header.key)
            return False
        if status == PutStatus.STORED and not evicted:
            with self._lock:
                if header.key in self.index:  # not deleted meanwhile
                    self.index.add(header, self.memory.level)
        return True

    # A chunk can be evicted from L1 between the tier accepting it and the index
    # learning of it (another thread's put needed the room). The eviction
    # callback marks such in-flight keys so the writer does not index a copy
    # that is already gone, and moves the bytes down itself.
    def _begin(self, key: ChunkKey) -> None:
        with self._lock:
            self._inflight[key] = self._inflight.get(key, 0) + 1

    def _end(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._end_locked(key)

    def _end_locked(self, key: ChunkKey) -> bool:
        """The key left the tier put; whether it was evicted meanwhile. Caller holds _lock."""
        n = self._inflight.pop(key, 1) - 1
        if n > 0:
            self._inflight[key] = n
        return self._evicted_inflight.pop(key, False) if n <= 0 else key in self._evicted_inflight

    def _touch(self, key: ChunkKey) -> None:
        entry = self.index.get(key)
        if entry is not None:
            entry.hits += 1
            entry.last_access_ms = wall_ms()

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
        """The longest stored prefix of ``tokens`` in this namespace (kvstore.lookup).

        ``count=False``: a repeat of a lookup already counted (Stats count a request once);
        ``local``: only what this host's tiers hold (no round trip to the remote).
        """
        self._check_open()
        remote: RemoteView | None = (
            self.remote if hasattr(self.remote, "children") and not local else None
        )
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
        (``kvstore.lookup.KeyChain``). Also the chunk whose sub-hashes the partial match
        needed and did not get (the answer then counts whole chunks, and is not counted
        in the stats: the caller asks again), or None."""
        self._check_open()
        cfg = self.config
        chain = KeyChain(
            keys, n_tokens, sub_hashes, cfg.chunk_tokens, cfg.granularity, sub_hashes_of
        )
        remote: RemoteView | None = self.remote if hasattr(self.remote, "children") else None
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
            with self._lock:
                self._counters["lookups"] += 1
                self._counters["lookup_tokens"] += result.total_tokens
                self._counters["matched_tokens"] += result.matched_tokens

    # -- management -----------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        with self._lock:
            entry = self.index.remove(key, "deleted")
        self._writer.forget(key)
        self._fallbacks.forget(key)
        found = entry is not None
        for tier in self.tiers:
            try:
                found = tier.delete(key) or found
            except TierError as e:
                log.warning("delete of %s from %s failed: %s", key.hex()[:16], tier.name, e)
        return found

    def clear(self, fingerprint: Fingerprint | None = None) -> int:
        """Remove every chunk of a namespace (or everything); returns chunks removed."""
        self._check_open()
        with self._lock:
            keys = self.index.keys(fingerprint)
            for key in keys:
                self.index.remove(key, "deleted")
            if fingerprint is None:
                self._layouts.clear()
            else:
                self._layouts.pop(fingerprint, None)
        self._fallbacks.clear()  # a moment's memory: dropping all of it costs nothing
        for key in keys:
            self._writer.forget(key)
        removed = len(keys)
        for tier in self.tiers:
            try:
                n = tier.clear(fingerprint)
            except TierError as e:
                log.warning("clear of %s failed: %s", tier.name, e)
                continue
            if tier is self.remote:
                removed = max(removed, n)
        return removed

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        """Keep a chunk from eviction in every tier that holds it."""
        self._check_open()
        entry = self.index.get(key)
        found = False
        for tier in self.tiers:
            if tier is self.remote or self._may_hold(tier, entry):
                try:
                    found = tier.pin(key, pinned) or found
                except TierError as e:  # the local tiers are pinned; the remote is best effort
                    log.warning("pin of %s in %s failed: %s", key.hex()[:16], tier.name, e)
        if entry is not None:
            entry.pinned = pinned
        return found

    def scan(self, fingerprint: Fingerprint | None = None) -> Iterator[ChunkView]:
        for key, e in self.index.items(fingerprint):
            yield ChunkView(
                key,
                e.fingerprint,
                e.parent,
                e.n_tokens,
                e.raw_size,
                e.dtype,
                tuple(tier_levels(e.tiers)),
                e.pinned,
                e.created_ms,
                e.last_access_ms,
                e.hits,
            )

    def namespaces(self) -> dict[Fingerprint, int]:
        with self._lock:
            return self.index.namespaces()

    def stats(self) -> StoreStats:
        jobs, nbytes = self._writer.pending
        with self._lock:
            c: dict[str, Any] = dict(self._counters)
            chunks, spaces = len(self.index), len(self.index.by_ns)
        tiers = [t.stats() for t in self.tiers]
        if self.remote is not None:  # copies waiting for it to come back, and those given up
            backlog = self._remote_backlog
            tiers[-1].detail.update(backlog=len(backlog), backlog_dropped=backlog.dropped)
        tiers[0].detail.update(self._fallbacks.detail())  # L1's refusals, decided once
        return StoreStats(
            chunks=chunks,
            namespaces=spaces,
            tiers=tiers,
            pending_writes=jobs,
            pending_bytes=nbytes,
            write_failures=self._writer.failures,
            **c,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued write-downs; False if they did not finish in time."""
        ok = self._writer.flush(timeout)
        flush_disk = getattr(self.disk, "flush", None)
        if callable(flush_disk):
            flush_disk()
        return ok

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish write-downs, then close every tier. Idempotent."""
        if self._closed:
            return
        if self.config.write_policy == "write-back":
            # Write-back only moves chunks down on eviction: persist what L1 alone holds.
            below = tuple(t.level for t in self._lower(1) if t is not self.remote)
            for key, entry in list(self.index.items()):
                if entry.tiers == 1 << self.memory.level and below:
                    self._writer.submit_copy(key, below[:1])
        self._writer.stop(timeout)
        self._closed = True
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception:  # closing the rest matters more than one failure
                log.exception("closing %s failed", tier.name)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _evict_callback(self, tier: Tier) -> Callable[[ChunkKey, RecordHeader, bytes], None]:
        def on_evict(key: ChunkKey, header: RecordHeader, blob: bytes) -> None:
            with self._lock:
                entry = self.index.get(key)
                below = self._lower(tier.level)
                if tier is self.memory and key in self._inflight:
                    self._evicted_inflight[key] = True
                    if entry is None:  # not indexed yet: index it here, then move it
                        entry = self.index.add(header, tier.level)
                        self._layouts.setdefault(header.fingerprint, _layout(header))
                if entry is None:
                    return
                holds_below = any(entry.tiers & (1 << t.level) for t in below)
                if below and not holds_below:
                    # Keep the entry alive under the target tier while the bytes travel.
                    entry.tiers = (entry.tiers & ~(1 << tier.level)) | (1 << below[0].level)
                else:
                    self.index.drop_tier(key, tier.level, "evicted")
                    return
            self._writer.submit_move(key, header, blob, below[0].level)

        return on_evict

    def _corrupt_callback(self, tier: Tier) -> Callable[[ChunkKey], None]:
        def on_corrupt(key: ChunkKey) -> None:
            with self._lock:
                self.index.drop_tier(key, tier.level, "corrupt")

        return on_corrupt

    # -- what a server needs beyond the data plane ----------------------------
    @property
    def arena(self) -> ArenaView:
        """L1's mapping of the arena: a server relays reservations and leases through it
        (``Reservation``/``ReadLease`` extents are offsets into it)."""
        return self.memory.arena

    def __contains__(self, key: object) -> bool:
        """Whether the index knows the chunk (in some tier, by this store's account)."""
        return key in self.index

    def fingerprint_of(self, key: ChunkKey) -> Fingerprint | None:
        """The namespace of an indexed chunk, or None."""
        entry = self.index.get(key)
        return None if entry is None else entry.fingerprint

    def renew(self, hold_id: int) -> bool:
        """Extend an L1 lease or reservation (``MemoryTier.renew``)."""
        return self.memory.renew(hold_id)

    def hold_info(self, hold_id: int) -> tuple[str, str, int] | None:
        """(owner, kind, payload bytes) of an L1 lease or reservation (``MemoryTier.hold_info``)."""
        return self.memory.hold_info(hold_id)

    def renew_owner(self, owner: str) -> int:
        """Renew every L1 lease and reservation of ``owner`` (``MemoryTier.renew_owner``)."""
        return self.memory.renew_owner(owner)

    def release_owner(self, owner: str) -> int:
        """Drop every L1 lease and reservation of ``owner`` (``MemoryTier.release_owner``)."""
        return self.memory.release_owner(owner)

    def upkeep(self) -> int:
        """What must happen now and then, whoever runs the store: expired leases and
        reservations reclaimed, copies the remote refused queued again once it takes
        writes. Returns how many holds were reclaimed. A server calls it periodically."""
        reclaimed = self.memory.sweep()
        self.retry_remote()
        return reclaimed

    def retry_remote(self, max_keys: int = 256) -> int:
        """Queue copies to the remote of chunks it refused while down, if it takes calls
        again; how many were queued (part of ``upkeep``)."""
        remote = self.remote
        if remote is None or not len(self._remote_backlog) or not remote.accepting:
            return 0
        queued = 0
        for key in self._remote_backlog.take(max_keys):
            with self._lock:
                entry = self.index.get(key)
                wanted = entry is not None and remote.level not in tier_levels(entry.tiers)
            if wanted:
                self._writer.submit_copy(key, (remote.level,))
                queued += 1
        return queued

    def _run_job(self, job: Job) -> None:
        header, payload = job.header, None
        remote = self.remote
        held = remote is not None and job.targets == (remote.level,) and not remote.accepting
        if header is None and held:  # down, or refusing writes: keep the key, skip the read
            self._remote_backlog.add(job.key)
            return
        if header is None:  # a copy: read the bytes from a local tier now
            blob = self.memory.get(job.key, internal=True)
            if blob is None:  # evicted from L1 since: its move holds the bytes, or L2 does
                moving = self._writer.pending_move(job.key)
                blob = moving[1] if moving is not None else None
            if blob is None and self.disk is not None and job.targets != (self.disk.level,):
                blob = self.disk.get(job.key)
            if blob is None:
                return  # evicted or deleted since; eviction queued its own move
            header = parse_header(blob)
            payload = memoryview(blob)[header.header_size :]
        else:
            assert job.blob is not None
            payload = memoryview(job.blob)[header.header_size :]
        for level in job.targets:
            if job.key not in self.index:
                return  # deleted while queued
            tier = self._by_level[level]
            status = tier.put(header, payload)
            with self._lock:
                alive = job.key in self.index
                if alive and status.ok:
                    self.index.add(header, level)
                elif alive and job.header is not None:
                    self.index.drop_tier(job.key, level, "evicted")
            if not alive:
                tier.delete(job.key)  # lost a race with delete: undo
            elif tier is self.remote and status == PutStatus.UNAVAILABLE:
                self._remote_backlog.add(job.key)  # copied again when it takes writes
            elif not status.ok:
                log.warning(
                    "write-down of %s to %s: %s", job.key.hex()[:16], tier.name, status.value
                )
            elif tier is self.remote and len(self._remote_backlog):
                self.retry_remote(64)  # it is back: catch up a little with every copy


REMOTE_BACKLOG_KEYS = 100_000  # chunks remembered for the remote while it is down (32 B each)


def _layout(header: RecordHeader) -> tuple[str, int, int]:
    return header.dtype, header.raw_size, header.n_tokens
