"""The store's write-down: eviction moving chunks to the tier below, copies of
write-through, and copies the remote refused while it was down, queued again.

A mixin of ``kvstore.engine.store.TieredStore`` (``WriteDownPath``), split out of it as
``kvstore.engine.store_reads`` is; the jobs run on the writer's thread (``kvstore.engine.writer``).
Eviction callbacks run with the evicting tier's lock held: they take the store's
lock, never the reverse (the store's docstring).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.engine.fallback import Fallbacks
from kvstore.engine.index import Index, layout_of, tier_levels
from kvstore.engine.tiers.base import EvictCallback, Tier
from kvstore.engine.tiers.memory import MemoryTier
from kvstore.engine.writer import Backlog, Job, WriteDown
from kvstore.keys import ChunkKey, Fingerprint
from kvstore.records import RecordHeader, parse_header
from kvstore.types import PutStatus

log = logging.getLogger("kvstore.engine.store")

REMOTE_BACKLOG_KEYS = 100_000  # chunks remembered for the remote while it is down (32 B each)


class WriteDownPath:
    if TYPE_CHECKING:  # the store's state this works on (TieredStore sets it up)
        memory: MemoryTier
        disk: Tier | None
        remote: Tier | None
        index: Index
        _lock: threading.RLock
        _fallbacks: Fallbacks
        _writer: WriteDown
        _remote_backlog: Backlog
        _by_level: dict[int, Tier]
        _layouts: dict[Fingerprint, tuple[str, int, int]]
        _inflight: dict[ChunkKey, int]
        _evicted_inflight: dict[ChunkKey, bool]

        def _lower(self, level: int) -> list[Tier]: ...

    def _evict_callback(self, tier: Tier) -> EvictCallback:
        def on_evict(key: ChunkKey, header: RecordHeader, read: Callable[[], bytes | None]) -> None:
            with self._lock:
                entry = self.index.get(key)
                below = self._lower(tier.level)
                if tier is self.memory and key in self._inflight:
                    self._evicted_inflight[key] = True
                    if entry is None:  # not indexed yet: index it here, then move it
                        entry = self.index.add(header, tier.level)
                        self._layouts.setdefault(header.fingerprint, layout_of(header))
                if entry is None:
                    return
                holds_below = any(entry.tiers & (1 << t.level) for t in below)
                if below and not holds_below:
                    # Keep the entry alive under the target tier while the bytes travel.
                    entry.tiers = (entry.tiers & ~(1 << tier.level)) | (1 << below[0].level)
                else:  # already below (written through): its bytes are not even read
                    self.index.drop_tier(key, tier.level, "evicted")
                    return
            try:
                blob = read()
            except BaseException:  # nothing moves: the entry must not point below
                with self._lock:
                    self.index.drop_tier(key, below[0].level, "evicted")
                raise
            if blob is None:  # damaged (the tier counted it): nothing to move
                with self._lock:
                    self.index.drop_tier(key, below[0].level, "corrupt")
                return
            self._writer.submit_move(key, header, blob, below[0].level)

        return on_evict

    def _corrupt_callback(self, tier: Tier) -> Callable[[ChunkKey], None]:
        def on_corrupt(key: ChunkKey) -> None:
            with self._lock:
                self.index.drop_tier(key, tier.level, "corrupt")

        return on_corrupt

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
        remote = self.remote
        held = remote is not None and job.targets == (remote.level,) and not remote.accepting
        if job.header is None and held:  # down, or refusing writes: keep the key, skip the read
            self._remote_backlog.add(job.key)
            return
        if job.header is not None:  # a move: the bytes travel with the job
            assert job.blob is not None
            self._write_down(job, job.header, job.blob)
            return
        # A copy: read from L1 now (verified), not counted as a client's read. (Reading it
        # in place under a lease would spare the bytes copy, but a lease of the store's
        # own would show in the tier's active_leases while the copy runs.)
        blob = self.memory.get(job.key, internal=True)
        if blob is None:  # evicted from L1 since: its move holds the bytes, or L2 does
            moving = self._writer.pending_move(job.key)
            blob = moving[1] if moving is not None else None
        if blob is None and self.disk is not None and job.targets != (self.disk.level,):
            blob = self.disk.get(job.key)
        if blob is None:
            return  # evicted or deleted since; eviction queued its own move
        header = parse_header(blob)
        self._write_down(job, header, blob)

    def _write_down(self, job: Job, header: RecordHeader, record: bytes) -> None:
        """Write one job's chunk (its whole record, as read) to each of its target tiers,
        and index where it landed."""
        for level in job.targets:
            if job.key not in self.index:
                return  # deleted while queued
            tier = self._by_level[level]
            status = tier.put_record(header, record)
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
