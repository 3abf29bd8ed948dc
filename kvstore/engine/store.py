"""TieredStore: composes L1 memory, L2 disk and L3 remote behind one API.

- put lands in L1 and is written down asynchronously (write-through), or only
  when evicted (write-back). Whatever the policy, a chunk evicted from a tier
  moves to the next lower tier when that tier exists and lacks it.
- get searches top-down; a hit below L1 is promoted into L1 (the read path,
  ``kvstore.engine.store_reads``, prefetch included); eviction and copies move chunks
  down (``kvstore.engine.store_writedown``).
- lookup is partial prefix matching over all tiers (kvstore.engine.lookup).
- drop deletes what a consumer loaded once no one else holds it
  (``kvstore.engine.store_drops``); delete, clear, pin and scan are an operator's
  (``kvstore.engine.store_admin``).
- the store is the only writer of the index. Its lock guards the index only:
  tiers are never called while holding it (tier locks may be held when it is
  taken, by eviction callbacks), which keeps the lock order acyclic.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.arena import ArenaView
from kvstore.clock import Clock, monotonic, wall_ms
from kvstore.config import StoreConfig
from kvstore.engine.fallback import Fallbacks
from kvstore.engine.index import Entry, Index, layout_of
from kvstore.engine.store_admin import AdminPath
from kvstore.engine.store_drops import DropPath
from kvstore.engine.store_reads import ReadPath
from kvstore.engine.store_writedown import REMOTE_BACKLOG_KEYS, WriteDownPath
from kvstore.engine.tiers.base import Tier
from kvstore.engine.tiers.disk_loans import LOAN_BIT, Lent, Loans
from kvstore.engine.tiers.memory import MemoryTier
from kvstore.engine.tiers.pages import ReadLease, Reservation
from kvstore.engine.writer import Backlog, Prefetcher, WriteDown
from kvstore.errors import ConfigError, InvalidArgument, StoreClosed
from kvstore.keys import ChunkKey, Fingerprint, chunk_key, tokens_to_bytes
from kvstore.presence import Presence
from kvstore.records import RecordHeader, check_put, make_header
from kvstore.types import PutStatus, StoreStats

# the holds the store's methods hand out
__all__ = ["Lent", "ReadLease", "Reservation", "TieredStore"]

log = logging.getLogger("kvstore.engine.store")

PREFETCH_THREADS = 2  # LMDB reads and L3 round trips overlap; more would fight the RPC threads


class TieredStore(ReadPath, WriteDownPath, DropPath, AdminPath):
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
                from kvstore.engine.tiers.disk import DiskTier

                disk = DiskTier(
                    cfg.disk, cfg.data_dir, clock=clock, lease_s=cfg.memory.lease_ms / 1000
                )
            if remote is None and cfg.remote.url:
                from kvstore.engine.tiers.remote import RemoteTier

                remote = RemoteTier(cfg.remote, clock=clock, granularity=cfg.granularity)
            filed_at = getattr(remote, "granularity", cfg.granularity)
            if filed_at != cfg.granularity:  # its partial matches would never be found
                raise ConfigError(
                    f"the remote tier files chunks for partial matching at granularity "
                    f"{filed_at}; this store's is {cfg.granularity}: build it with the "
                    "store's (RemoteTier(..., granularity=config.granularity))"
                )
        except BaseException:
            for tier in (disk, self.memory):
                if tier is not None:
                    tier.close()
            raise
        self.disk, self.remote = disk, remote
        self.tiers: list[Tier] = [t for t in (self.memory, disk, remote) if t is not None]
        self._by_level = {t.level: t for t in self.tiers}
        self.index = Index(cfg.granularity)
        offset, size = self.memory.presence_region()
        if size and remote is None:  # another host's chunks match here unfiled: no filter
            self.index.presence = Presence(self.memory.arena.array[offset : offset + size])
            self.index.presence.init()
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
            "dropped": 0,
            "drops_deferred": 0,
        }
        for tier in self.tiers:
            tier.on_evict = self._evict_callback(tier)
            tier.on_corrupt = self._corrupt_callback(tier)
        self._rebuild()
        self._writer = WriteDown(self._run_job, cfg.write_queue_bytes)
        # Promotions lookups asked for ahead of their reads: a few threads, at most a
        # quarter of L1 queued or running (they would only evict each other past that).
        budget = min(cfg.write_queue_bytes, cfg.memory.capacity_bytes // 4)
        self._prefetcher = Prefetcher(self._prefetch_one, budget, threads=PREFETCH_THREADS)
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
            self._layouts.setdefault(info.header.fingerprint, layout_of(info.header))
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
        dtype, raw, ntok = layout_of(header)
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
        self._writer.writing()
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
                    self._layouts.setdefault(header.fingerprint, layout_of(header))
                return st
        return status

    def _index_locked(
        self, header: RecordHeader, level: int, prepared: Entry | None = None
    ) -> None:
        self.index.add(header, level, prepared=prepared)
        if header.fingerprint not in self._layouts:
            self._layouts[header.fingerprint] = layout_of(header)

    def _committed(self, header: RecordHeader) -> None:
        # The entry (the sub-hashes of its tokens) is built before the lock, as put does:
        # concurrent commits then hold the store's lock only to insert it.
        prepared = self.index.prepare(header, self.memory.level)
        with self._lock:
            self._index_locked(header, self.memory.level, prepared)
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
        self._writer.writing()
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
        self._writer.writing()
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
        tiers[0].detail.update(self._prefetcher.detail())  # promotions ahead of the reads
        if (presence := self.index.presence) is not None:
            tiers[0].detail["presence_fill"] = round(presence.fill(), 6)
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
        if self.index.presence is not None:  # its clients stop trusting it now
            self.index.presence.vouch(0)
        if self.config.write_policy == "write-back":
            # Write-back only moves chunks down on eviction: persist what L1 alone holds.
            below = tuple(t.level for t in self._lower(1) if t is not self.remote)
            for key, entry in list(self.index.items()):
                if entry.tiers == 1 << self.memory.level and below:
                    self._writer.submit_copy(key, below[:1])
        self._prefetcher.stop(timeout)  # before the write-down: promotions may evict
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

    # -- what a server needs beyond the data plane ----------------------------
    @property
    def tier_names(self) -> list[str]:
        """The tiers this store runs, top down (``memory``, ``disk``, ``remote``)."""
        return [t.name for t in self.tiers]

    @property
    def arena(self) -> ArenaView:
        """L1's mapping of the arena: a server relays reservations and leases through it
        (``Reservation``/``ReadLease`` extents are offsets into it)."""
        return self.memory.arena

    @property
    def arena_pages_bytes(self) -> int:
        """The bytes of the arena that hold L1's pages: what a same-host client maps to
        read and write chunks (the file goes on with the presence filter)."""
        return self.memory.capacity_bytes

    def presence(self) -> tuple[int, int, int] | None:
        """(offset, bytes, nonce) of the presence filter in the arena file
        (``kvstore.presence``), for same-host clients to map; None: no filter (none
        configured, or a remote tier whose chunks match here without being filed)."""
        p = self.index.presence
        if p is None:
            return None
        offset, size = self.memory.presence_region()
        return offset, size, p.nonce()

    def vouch_presence(self, live_for_s: float) -> None:
        """Vouch for the presence filter for ``live_for_s`` more seconds: clients trust its
        clear bits only while the process keeping it vouches (a server, at each sweep)."""
        p = self.index.presence
        if p is not None and not self._closed:
            p.vouch(int((self._clock() + live_for_s) * 1e9))

    def count_lookups(self, lookups: int, tokens: int) -> None:
        """Count lookups a client answered itself by the presence filter (misses, each of
        ``tokens`` prompt tokens in all) as if they had been asked here."""
        if lookups > 0:
            self._add_lookups(lookups, tokens, 0)

    def __contains__(self, key: object) -> bool:
        """Whether the index knows the chunk (in some tier, by this store's account)."""
        return key in self.index

    def fingerprint_of(self, key: ChunkKey) -> Fingerprint | None:
        """The namespace of an indexed chunk, or None."""
        entry = self.index.get(key)
        return None if entry is None else entry.fingerprint

    def renew(self, hold_id: int) -> bool:
        """Extend an L1 lease or reservation (``MemoryTier.renew``), or an L2 loan."""
        if hold_id & LOAN_BIT:
            return (loans := self._loans()) is not None and loans.renew(hold_id)
        return self.memory.renew(hold_id)

    def hold_info(self, hold_id: int) -> tuple[str, str, int] | None:
        """(owner, kind, payload bytes) of an L1 lease or reservation
        (``MemoryTier.hold_info``) or of an L2 loan (kind "lease")."""
        if hold_id & LOAN_BIT:
            return None if (loans := self._loans()) is None else loans.info(hold_id)
        return self.memory.hold_info(hold_id)

    def renew_owner(self, owner: str) -> int:
        """Renew every L1 lease and reservation and every L2 loan of ``owner``."""
        loans = self._loans()
        return self.memory.renew_owner(owner) + (loans.renew_owner(owner) if loans else 0)

    def release_owner(self, owner: str) -> int:
        """Drop every L1 lease and reservation and every L2 loan of ``owner``."""
        loans = self._loans()
        n = self.memory.release_owner(owner) + (loans.release_owner(owner) if loans else 0)
        self._drop_due()
        return n

    def lending_file(self) -> tuple[str, int] | None:
        """(path, map size) of the file L2 lends records in (``lend``), if L2 is LMDB."""
        lender = self.lender
        return None if lender is None else (lender.data_file, lender.map_size)

    def _loans(self) -> Loans | None:
        """L2's loans (``DiskTier.lend``), if L2 is LMDB."""
        lender = self.lender
        return None if lender is None else lender.loans

    def upkeep(self) -> int:
        """What must happen now and then, whoever runs the store: expired leases and
        reservations reclaimed, copies the remote refused queued again once it takes
        writes. Returns how many holds were reclaimed. A server calls it periodically."""
        reclaimed = self.memory.sweep()
        if (loans := self._loans()) is not None:
            reclaimed += loans.sweep()
        self._drop_due()  # dropped chunks whose last hold expired, or was an in-process read
        self.retry_remote()
        return reclaimed
