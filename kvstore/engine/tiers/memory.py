"""L1: chunk records in a shared-memory arena, with a zero-copy data plane.

The arena is one file (``/dev/shm/kvstore-<pid>-<hex>`` unless ``config.path``
says otherwise), mapped by this process and, by path, by same-host clients. It
is cut into ``config.page_bytes`` pages; a record (packed header, then the RAW
payload) occupies one or more extents (``kvstore.arena``). The index
(key -> extents, LRU order, pins, leases) lives only in this process: L1 is
volatile and starts empty.

Data plane for other processes (the server relays these calls):

- ``reserve`` allocates pages and writes the header; the client writes the
  payload at ``payload_offset`` over the extents; ``commit`` checks the header
  is untouched (the client is untrusted) and makes the key visible; the payload
  is checked by every read (and at commit only with ``verify_reads`` off: see the
  policy below). A bad commit frees the pages, counts in ``stats().corrupt`` and
  raises ``CorruptRecord``.
- ``acquire`` returns a verified ``ReadLease``; the pages stay put (never
  evicted or freed, even if the chunk is deleted) until ``release``.
- Reservations and leases (one table, ``tiers.holds``: ids, expiry, owners) expire
  ``config.lease_ms`` after they were handed out or last renewed, on the injected
  clock; expired ones are reclaimed by ``sweep()`` and before every allocation, so a
  dead client cannot leak pages. ``release_owner`` drops everything one client holds
  when it disconnects.
- A *lasting* hold (``reserve(..., lasting=True)``, ``acquire(..., lasting=True)``)
  never expires: it is for the server's own Put and Get streams, which relay bytes
  into or out of the pages for as long as the stream lives, however slowly it
  moves, and give the hold back when the stream ends (the server bounds how long
  a stream may live). A hold that expired under a live stream would hand its pages
  to another chunk while the stream still writes or reads them.
- Hold ids are random: an id is a capability (``tiers.holds``).

The read path (``get``, ``get_into``, ``acquire``, ``contains``, ``scan`` and what a
read does with a record that fails its check) is ``memory_reads.L1Reads``, a mixin; the
holds (``reserve``, ``commit``, ``release``, renewal, expiry) are ``memory_holds.L1Holds``.

Verification policy: every payload is hashed at least once on its way out of the
arena, never on its way in when a reader will. Reads (``get``, ``get_into``,
``acquire``, the write-down's reads) and evictions verify when ``config.verify_reads``;
a record that fails is deleted, counted in ``stats().corrupt`` and a miss. ``commit``
always checks the header, and the payload only when reads do not (``verify_reads``
off): with reads verifying, hashing the pages at commit too would be a second pass over
every saved byte that no reader needs (it only told a faulty writer sooner), and on a
host that runs the engine too that pass is CPU taken from it. The in-process ``put``
does not hash the payload again: its header came from ``make_header`` over the same
bytes.
Header checks compare the arena's header bytes with the packed header kept in
the index, which also catches flips in the padding. ``get_into`` hashes the
bytes as it copies them (``accel.scatter_xxh3``; with AVX2 what is stored and what
is hashed come from the same registers): that checks exactly the bytes
delivered, even if a rogue writer touches the arena meanwhile.

``stats().used_bytes`` counts committed record bytes, as the contract says;
page usage (including pages still held by reservations, evictions in flight and
chunks deleted while leased) is in ``detail``. ``capacity_bytes`` is the arena
size rounded down to whole pages. ``last_access_ms`` is wall-clock time (like
``created_ms``), for inspection only; LRU order does not depend on it.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import weakref
from collections import OrderedDict
from dataclasses import replace

import xxhash

from kvstore.arena import (
    ArenaView,
    Extent,
    default_arena_path,
    flat_view,
    remove_stale_arenas,
)
from kvstore.clock import Clock, monotonic, wall_ms
from kvstore.config import MemoryConfig
from kvstore.engine.tiers.base import Tier
from kvstore.engine.tiers.holds import HoldTable
from kvstore.engine.tiers.memory_holds import L1Holds
from kvstore.engine.tiers.memory_reads import Entry, L1Reads
from kvstore.engine.tiers.pages import LeaseError, PageAllocator, ReadLease, Reservation
from kvstore.errors import ConfigError, CorruptRecord, InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.presence import region_bytes
from kvstore.records import Codec, RecordHeader, check_put, parse_header, transcode_parts
from kvstore.types import PutStatus, TierLevel, TierStats

__all__ = ["LeaseError", "MemoryTier", "ReadLease", "Reservation"]

log = logging.getLogger(__name__)


class MemoryTier(L1Reads, L1Holds, Tier):
    """The shared-memory arena tier. Thread-safe: one lock guards the index."""

    name = TierLevel.MEMORY.label
    level = TierLevel.MEMORY

    def __init__(
        self,
        config: MemoryConfig,
        *,
        clock: Clock = monotonic,
        create: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        if not create and not config.path:
            raise ConfigError("memory.path must name an existing arena when create=False")
        self.config = config
        self.page_bytes = config.page_bytes
        n_pages = config.capacity_bytes // config.page_bytes
        self.capacity_bytes = n_pages * config.page_bytes
        self.path = config.path or default_arena_path()
        if not config.path and create:
            for stale in remove_stale_arenas(os.path.dirname(self.path)):
                log.info("removed the arena %s of a kvstore process that is gone", stale)
        self.presence_bytes = region_bytes(config.presence_bytes)  # after the pages
        size = self.capacity_bytes + self.presence_bytes  # (kvstore.presence): one file
        self._arena = ArenaView.own(self.path, size, create=create)
        self._finalizer = weakref.finalize(self, self._arena.close)  # no leak in /dev/shm
        self._clock = clock
        self._verify = config.verify_reads
        self._alloc = PageAllocator(n_pages)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # pages came back (an eviction ended)
        self._chunks: OrderedDict[ChunkKey, Entry] = OrderedDict()  # LRU first
        # hold ids: unguessable unless rng is injected
        self._holds = HoldTable[Entry](
            config.lease_ms / 1000.0, clock, rng or random.SystemRandom()
        )
        self._due: dict[ChunkKey, Entry] = {}  # dropped chunks whose last hold ended
        self._evicting_pages = 0
        self._used_bytes = 0
        self._internal_reads = 0
        self._internal_bytes = 0
        self._stats = TierStats(self.name, self.level, self.capacity_bytes)

    # -- allocation and eviction -----------------------------------------------
    def _allocate(self, header: RecordHeader, *, new_key: bool = False) -> Entry | PutStatus:
        """Pages for ``header.record_size`` bytes, evicting LRU chunks as needed.

        ``new_key``: EXISTS if the key is already stored, checked under the lock
        that allocates (one trip through the lock on the hot path, not two).
        """
        packed = header.pack()  # before taking the lock
        need = -(-header.record_size // self.page_bytes)
        if need > self._alloc.n_pages:
            with self._lock:
                if new_key:
                    self._check_open()
                    if header.key in self._chunks:
                        return PutStatus.EXISTS
                self._stats.rejected += 1
            return PutStatus.TOO_LARGE
        while True:
            with self._lock:
                self._check_open()
                if new_key and header.key in self._chunks:
                    return PutStatus.EXISTS
                self._sweep_locked()
                runs = self._alloc.alloc(need)
                if runs is not None:
                    return self._new_entry(header, runs, packed)
                victims = self._pick_victims(need - self._alloc.free_pages)
                if not victims:
                    if self._evicting_pages:  # another thread's eviction may be enough
                        self._freed.wait(timeout=1.0)
                        continue
                    self._stats.rejected += 1
                    return PutStatus.FULL
            self._evict(victims)

    def _new_entry(self, header: RecordHeader, runs: list[Extent], packed: bytes) -> Entry:
        page, size = self.page_bytes, header.record_size
        if len(runs) == 1:
            extents: tuple[Extent, ...] = ((runs[0][0] * page, size),)
        else:
            out, left = [], size
            for first, n in runs:
                out.append((first * page, min(n * page, left)))
                left -= out[-1][1]
            extents = tuple(out)
        return Entry(header, packed, runs, extents, len(packed), size)

    def _pick_victims(self, deficit: int) -> list[Entry]:
        """LRU chunks that free ``deficit`` pages, taken out of the index; [] if impossible."""
        victims, got = [], 0
        for entry in self._chunks.values():
            if got >= deficit:
                break
            if not entry.pinned and entry.refs == 0:
                victims.append(entry)
                got += entry.n_pages
        if got + self._evicting_pages < deficit:
            return []  # evicting these would not make room: keep them
        if got < deficit:
            return []  # in-flight evictions may suffice; the caller waits for them
        for entry in victims:
            self._unindex(entry)
            self._evicting_pages += entry.n_pages
        self._stats.evictions += len(victims)
        return victims

    def _evict(self, victims: list[Entry]) -> None:
        """Hand each victim to on_evict (outside the lock), then give its pages back."""
        errors = 0
        try:
            for entry in victims:
                callback = self.on_evict
                if callback is None:
                    continue
                try:
                    callback(
                        entry.header.key,
                        entry.header,
                        functools.partial(self._evicted_record, entry),
                    )
                except Exception:
                    errors += 1
                    log.exception("on_evict failed for chunk %s", entry.header.key.hex())
        finally:
            with self._lock:
                for entry in victims:
                    self._evicting_pages -= entry.n_pages
                    self._free_locked(entry)
                self._stats.errors += errors

    def _evicted_record(self, entry: Entry) -> bytes | None:
        """An evicted chunk's whole record, verified (``on_evict``'s reader): a copy read
        only when the store moves it down (one already written through is not read)."""
        blob = self._arena.read(entry.extents, 0, entry.size)
        if self._verify and not self._blob_ok(entry, blob):
            # Pushing it down would only move the damage.
            if self._mark_damaged(entry):
                with self._lock:
                    self._stats.corrupt += 1
                self._report_corrupt(entry.header.key)
            return None
        return blob

    def _unindex(self, entry: Entry) -> None:
        del self._chunks[entry.header.key]
        self._used_bytes -= entry.size
        entry.deleted = True

    def _remove_locked(self, entry: Entry) -> None:
        self._unindex(entry)
        if entry.refs == 0:
            self._free_locked(entry)

    def _free_locked(self, entry: Entry) -> None:
        if entry.pages:
            self._alloc.free(entry.pages)
            entry.pages = []
            self._freed.notify_all()

    def _unref_locked(self, entry: Entry) -> None:
        entry.refs -= 1
        if entry.refs == 0 and entry.deleted:
            self._free_locked(entry)
        elif entry.refs == 0 and entry.drop:
            self._due[entry.header.key] = entry

    def _publish(self, entry: Entry) -> PutStatus:
        """Make a fully written record visible, unless the key won the race elsewhere."""
        with self._lock:
            key = entry.header.key
            if self._closed or key in self._chunks:
                self._free_locked(entry)
                self._check_open()
                return PutStatus.EXISTS
            entry.last_access_ms = wall_ms()
            self._chunks[key] = entry
            self._used_bytes += entry.size
            self._stats.puts += 1
            self._stats.bytes_in += entry.size
            return PutStatus.STORED

    # -- writes ------------------------------------------------------------------
    def _check_raw(self, header: RecordHeader) -> None:
        check_put(header)  # written in place, read in place: RAW and self-consistent

    def put(
        self, header: RecordHeader, payload: bytes | memoryview, *, verify: bool = False
    ) -> PutStatus:
        """``verify``: the payload comes from a copy that may have rotted (a promotion from
        L2 straight out of LMDB's map): hash it as it is copied into the pages and raise
        CorruptRecord (pages freed) if it does not match its header's checksum. Without
        it the header is trusted to describe the payload (made by ``make_header`` over it).
        """
        if header.codec != Codec.RAW:  # L1 is read in place: decode compressed records once here
            self._check_open()
            if verify and xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
                raise CorruptRecord("payload checksum mismatch")
            try:
                blob = transcode_parts(header, payload, Codec.RAW)
            except CorruptRecord as e:
                raise InvalidArgument(f"record does not decode: {e}") from e
            header = parse_header(blob)
            payload = memoryview(blob)[header.header_size :]
        src = flat_view(payload)
        if src.nbytes != header.stored_size:
            raise InvalidArgument(
                f"payload is {src.nbytes} bytes, its header says {header.stored_size}"
            )
        entry = self._allocate(header, new_key=True)
        if isinstance(entry, PutStatus):
            return entry
        try:  # the entry is in no table: nothing can reclaim it while we copy
            self._arena.write(entry.extents, 0, entry.packed)
            if not verify:
                self._arena.write(entry.extents, entry.hs, src)
            elif self._arena.write_hashed(entry.extents, entry.hs, src) != (
                header.payload_checksum
            ):
                raise CorruptRecord("payload checksum mismatch")
        except BaseException:
            with self._lock:
                self._free_locked(entry)
            raise
        return self._publish(entry)

    def delete(self, key: ChunkKey) -> bool:
        """Remove a chunk; a leased one leaves the index now and frees its pages on release."""
        with self._lock:
            self._check_open()
            entry = self._chunks.get(key)
            if entry is None:
                return False
            self._remove_locked(entry)
            return True

    def mark_drop(self, key: ChunkKey) -> int | None:
        """A consumer's drop of a chunk: None if this tier does not hold it, 0 if nothing
        holds it (the store deletes it from every tier now), else how many holds (leases,
        in-process reads) it waits for. Such a chunk stays readable and can be leased
        again meanwhile; once the last hold ends it is handed to ``take_dropped``. The
        tier does not delete it itself: the store removes it from every tier and the
        index, which a tier must not reach from under its own lock."""
        with self._lock:
            self._check_open()
            entry = self._chunks.get(key)
            if entry is None:
                return None
            if entry.refs == 0:
                return 0
            entry.drop = True
            return entry.refs

    def take_dropped(self) -> list[ChunkKey]:
        """The dropped chunks whose last hold has ended since the last call and that
        nobody leased again since (an evicted one too: it moved down, and the store
        deletes it from every tier)."""
        if not self._due:  # the common case, read without the lock: a release with no drop
            return []
        with self._lock:
            due, self._due = self._due, {}
            return [k for k, e in due.items() if e.refs == 0 and self._chunks.get(k) in (e, None)]

    def clear(self, fingerprint: bytes | None = None) -> int:
        with self._lock:
            self._check_open()
            doomed = [
                e
                for e in self._chunks.values()
                if fingerprint is None or e.header.fingerprint == fingerprint
            ]
            for entry in doomed:
                self._remove_locked(entry)
            return len(doomed)

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        with self._lock:
            self._check_open()
            entry = self._chunks.get(key)
            if entry is None:
                return False
            entry.pinned = pinned
            return True

    # -- inspection and lifecycle -----------------------------------------------------
    @property
    def arena(self) -> ArenaView:
        """The tier's own mapping: a server relays reservations and leases through it."""
        return self._arena

    def presence_region(self) -> tuple[int, int]:
        """(offset, bytes) of the presence filter in the arena file; (0, 0): none."""
        return (self.capacity_bytes, self.presence_bytes) if self.presence_bytes else (0, 0)

    def stats(self) -> TierStats:
        with self._lock:
            a = self._alloc
            pending = {id(e) for e in self._holds.entries("lease") if e.deleted}
            return replace(
                self._stats,
                used_bytes=self._used_bytes,
                chunks=len(self._chunks),
                healthy=not self._closed,
                detail={  # page figures include reservations and chunks still leased
                    "path": self.path,
                    "page_bytes": self.page_bytes,
                    "pages_total": a.n_pages,
                    "pages_used": a.n_pages - a.free_pages,
                    "pages_free": a.free_pages,
                    "free_extents": a.fragments,
                    "largest_free_pages": a.largest_free,
                    "active_leases": self._holds.leases,
                    "reservations": self._holds.reservations,
                    "deleted_while_leased": len(pending),
                    "drops_waiting": sum(1 for e in self._chunks.values() if e.drop),
                    "evicting_pages": self._evicting_pages,
                    "expired": self._holds.expired,
                    "internal_reads": self._internal_reads,
                    "internal_bytes_out": self._internal_bytes,
                    "verify_reads": self._verify,
                    "pinned": sum(1 for e in self._chunks.values() if e.pinned),
                },
            )

    def close(self) -> None:
        """Unmap the arena and, if this tier created the file, unlink it."""
        with self._lock:
            if self._closed:
                return
            super().close()
            self._chunks.clear()
            self._holds.clear()
            self._freed.notify_all()
        self._finalizer()
