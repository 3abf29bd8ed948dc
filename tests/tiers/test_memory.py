"""What is special to L1: the page allocator, the shared-memory file, leases and the
zero-copy reserve/commit and acquire/release protocol. The behaviour every tier
shares is in the contract suite."""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.arena import ArenaView, Extent, spans
from kvstore.clock import FakeClock
from kvstore.config import MemoryConfig
from kvstore.engine.tiers.memory import LeaseError, MemoryTier, ReadLease, Reservation
from kvstore.engine.tiers.pages import PageAllocator
from kvstore.errors import CorruptRecord, InvalidArgument, KVStoreError, StoreClosed, TierError
from kvstore.keys import ROOT, ChunkKey, Fingerprint, Namespace, chunk_key, tokens_to_bytes
from kvstore.presence import region_bytes
from kvstore.records import Codec, RecordHeader, encode_payload, make_header, verify
from kvstore.types import PutStatus

PAGE = 4096
FP = Namespace(model="test-l1").fingerprint
HS = 256  # header bytes of a record with two tokens


def record(i: int, size: int, fp: Fingerprint = FP) -> tuple[RecordHeader, bytes]:
    """A RAW record with a ``size``-byte payload that is different for every ``i``."""
    tb = tokens_to_bytes([i, 7])
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = chunk_key(ROOT, fp, tb)
    header = make_header(
        key=key,
        parent=ROOT,
        fingerprint=fp,
        token_bytes=tb,
        dtype="uint8",
        shape=[size],
        payload=payload,
    )
    assert header.header_size == HS, header.header_size
    return header, payload


def pages_record(i: int, pages: int) -> tuple[RecordHeader, bytes]:
    """A record filling exactly ``pages`` pages."""
    return record(i, pages * PAGE - HS)


@pytest.fixture
def make_tier() -> Iterator[Callable[..., MemoryTier]]:
    tiers: list[MemoryTier] = []

    def make(pages: int = 8, clock: FakeClock | None = None, **kw: object) -> MemoryTier:
        cfg = MemoryConfig(capacity_bytes=pages * PAGE, page_bytes=PAGE, **kw)  # type: ignore[arg-type]
        tier = MemoryTier(cfg, clock=clock or FakeClock())
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def detail(tier: MemoryTier, name: str) -> int:
    value = tier.stats().detail[name]
    assert isinstance(value, int)
    return value


def extents_of(tier: MemoryTier, key: ChunkKey) -> tuple[Extent, ...]:
    lease = tier.acquire(key)
    assert lease is not None, "chunk should be present"
    assert tier.release(lease.id)
    return lease.extents


def flip_bit(tier: MemoryTier, key: ChunkKey, record_offset: int) -> None:
    """Corrupt one bit of a stored record through a second, independent mapping."""
    ((off, _, _),) = spans(extents_of(tier, key), record_offset, 1)
    with ArenaView.open(tier.path) as other:
        other.array[off] ^= 0x10


# -- the page allocator ------------------------------------------------------------
def test_allocator_prefers_one_contiguous_run_and_falls_back_to_several() -> None:
    a = PageAllocator(10)
    singles = [a.alloc(1) or [] for _ in range(10)]
    assert a.alloc(1) is None and a.free_pages == 0, "10 pages, 10 single allocations"
    for run in singles[::2]:
        a.free(run)  # free pages 0, 2, 4, 6, 8: five holes of one page
    assert (a.free_pages, a.fragments, a.largest_free) == (5, 5, 1)
    got = a.alloc(5)
    assert got == [(0, 1), (2, 1), (4, 1), (6, 1), (8, 1)], f"fragmented fallback gave {got}"
    assert a.alloc(1) is None, "exhausted allocator must refuse"


def test_allocator_best_fit_keeps_large_holes() -> None:
    a = PageAllocator(16)
    r = [a.alloc(n) or [] for n in (2, 1, 5, 1, 7)]  # pages 0-1, 2, 3-7, 8, 9-15
    assert a.free_pages == 0
    a.free(r[0])  # hole of 2 at 0
    a.free(r[2])  # hole of 5 at 3
    assert a.alloc(2) == [(0, 2)], "a 2-page request should take the 2-page hole, not split the 5"
    assert a.largest_free == 5


def test_allocator_coalesces_in_any_free_order_and_rejects_double_free() -> None:
    rng = random.Random(7)
    a = PageAllocator(64)
    held: list[list[Extent]] = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or a.free_pages == 0):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            got = a.alloc(rng.randint(1, 6))
            if got is not None:
                held.append(got)
        runs = a.runs()
        assert sum(n for _, n in runs) == a.free_pages, "free runs must add up to free_pages"
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in itertools.pairwise(runs)), (
            f"free runs must be sorted, disjoint and never adjacent: {runs}"
        )
        used = sorted(x for runs_ in held for s, n in runs_ for x in range(s, s + n))
        assert len(used) == len(set(used)) == 64 - a.free_pages, "pages handed out twice"
    for runs_ in held:
        a.free(runs_)
    assert a.runs() == [(0, 64)], "freeing everything must coalesce back to one run"
    got = a.alloc(3)
    assert got is not None
    a.free(got)
    with pytest.raises(KVStoreError, match="freed twice"):
        a.free(got)


def test_spans_walk_a_range_across_extents() -> None:
    ext = [(100, 10), (500, 10), (900, 5)]
    assert list(spans(ext, 5, 12)) == [(105, 0, 5), (500, 5, 7)]
    assert list(spans(ext, 0, 25)) == [(100, 0, 10), (500, 10, 10), (900, 20, 5)]
    with pytest.raises(InvalidArgument):
        list(spans(ext, 20, 6))


# -- the arena file ------------------------------------------------------------------
def test_arena_is_a_shared_memory_file_that_close_unlinks(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=8)
    assert tier.path.startswith("/dev/shm/kvstore-"), tier.path
    assert (tier.capacity_bytes, tier.page_bytes) == (8 * PAGE, PAGE)
    # the pages, then the presence filter's header and bits (kvstore.presence)
    assert tier.presence_bytes == region_bytes(MemoryConfig().presence_bytes)
    assert os.path.getsize(tier.path) == 8 * PAGE + tier.presence_bytes
    tier.close()
    assert not os.path.exists(tier.path), "close() must unlink the arena it created"
    with pytest.raises(StoreClosed):
        tier.get(record(0, 10)[0].key)
    with pytest.raises(StoreClosed):
        tier.scan()
    assert tier.stats().healthy is False, "stats must still answer after close"


def test_a_tier_dropped_without_close_leaves_nothing_in_dev_shm() -> None:
    tier = MemoryTier(MemoryConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE))
    path = tier.path
    tier.put(*record(1, 100))
    del tier
    gc.collect()
    assert not os.path.exists(path), "the finalizer must unlink an arena nobody closed"


def test_explicit_path_is_locked_and_create_false_leaves_the_file() -> None:
    path = f"/dev/shm/kvstore-test-{os.getpid()}-{secrets.token_hex(4)}"
    cfg = MemoryConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE, path=path)
    owner = MemoryTier(cfg)
    try:
        assert owner.path == path and os.path.exists(path)
        with pytest.raises(TierError, match="in use"):
            MemoryTier(cfg, create=False)
    finally:
        owner.close()
    assert not os.path.exists(path)
    with open(path, "wb") as f:
        f.truncate(4 * PAGE + region_bytes(cfg.presence_bytes))  # pages, presence filter
    try:
        with MemoryTier(cfg, create=False) as adopted:
            assert adopted.put(*record(1, 100)) is PutStatus.STORED
        assert os.path.exists(path), "create=False must not unlink a file it did not create"
    finally:
        os.unlink(path)


def test_a_view_maps_only_the_file_the_server_offered(tmp_path: Path) -> None:
    """A client maps the arena its server's Info named by path and inode: the same path
    naming another file (a server restarted there, another host's file) is refused."""
    path = str(tmp_path / "arena")
    with open(path, "wb") as f:
        f.truncate(4 * PAGE)
    offered = os.stat(path).st_ino
    with ArenaView.open(path, inode=offered, writable=False) as view:
        assert view.size == 4 * PAGE
    with open(path, "rb"):  # held open: the old inode cannot be reused by the new file
        os.unlink(path)
        with open(path, "wb") as f:  # a new file at the same path (a restart)
            f.truncate(4 * PAGE)
        with pytest.raises(TierError, match="not the file the server offered"):
            ArenaView.open(path, inode=offered, writable=False)
    with ArenaView.open(path, inode=os.stat(path).st_ino, writable=False, offset=PAGE) as view:
        assert view.size == 3 * PAGE


# -- put, get and eviction --------------------------------------------------------------
def test_records_span_fragmented_pages_without_evicting(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=8)
    evicted: list[bytes] = []
    tier.on_evict = lambda k, h, b: evicted.append(k)
    small = [pages_record(i, 1) for i in range(8)]
    for h, p in small:
        assert tier.put(h, p) is PutStatus.STORED
    for h, _ in small[::2]:
        assert tier.delete(h.key)
    assert detail(tier, "free_extents") == 4
    big_h, big_p = pages_record(100, 4)  # exactly the four free, scattered pages
    assert tier.put(big_h, big_p) is PutStatus.STORED, "enough free pages must suffice"
    assert evicted == [], "fragmentation alone must not evict anything"
    assert len(extents_of(tier, big_h.key)) == 4
    blob = tier.get(big_h.key)
    assert blob is not None and verify(blob) == big_h and blob[HS:] == big_p
    out = bytearray(len(big_p) + 10)
    assert tier.get_into(big_h.key, memoryview(out)) == big_h
    assert bytes(out[: len(big_p)]) == big_p, "get_into must reassemble the extents in order"


def test_lru_eviction_order_hands_verifiable_blobs_to_on_evict(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=4)
    evicted: list[tuple[ChunkKey, bytes]] = []
    tier.on_evict = lambda k, h, read: evicted.append((k, read()))
    recs = [pages_record(i, 1) for i in range(6)]
    for h, p in recs[:4]:
        assert tier.put(h, p) is PutStatus.STORED
    assert tier.get(recs[0][0].key) is not None  # 0 becomes most recently used
    assert tier.contains([recs[1][0].key]) == [True]  # contains must not touch LRU order
    for h, p in recs[4:]:
        assert tier.put(h, p) is PutStatus.STORED
    assert [k for k, _ in evicted] == [recs[1][0].key, recs[2][0].key], "LRU order: 1 then 2"
    for key, blob in evicted:
        header = verify(blob, expect_key=key)
        assert blob[HS:] == dict((h.key, p) for h, p in recs)[key], "evicted blob is the record"
        assert header.codec is Codec.RAW
    assert [c.key for c in tier.scan()] == [recs[i][0].key for i in (3, 0, 4, 5)]
    s = tier.stats()
    assert (s.evictions, s.chunks, s.used_bytes) == (2, 4, 4 * PAGE)


def test_pinned_and_leased_chunks_are_never_evicted(make_tier: Callable[..., MemoryTier]) -> None:
    tier = make_tier(pages=3)
    evicted: list[ChunkKey] = []
    tier.on_evict = lambda k, h, b: evicted.append(k)
    recs = [pages_record(i, 1) for i in range(5)]
    for h, p in recs[:3]:
        tier.put(h, p)
    assert tier.pin(recs[0][0].key)
    lease = tier.acquire(recs[1][0].key, owner="reader")
    assert lease is not None
    assert tier.put(*recs[3]) is PutStatus.STORED
    assert evicted == [recs[2][0].key], "only the unpinned, unleased chunk may go"
    assert tier.put(*pages_record(50, 2)) is PutStatus.FULL, "2 pages needed, 1 evictable"
    assert tier.contains([recs[3][0].key]) == [True], "a FULL put must not evict for nothing"
    assert tier.put(*pages_record(51, 4)) is PutStatus.TOO_LARGE
    assert tier.stats().rejected == 2
    assert tier.release(lease.id)
    assert tier.pin(recs[0][0].key, False)
    assert tier.put(*pages_record(52, 3)) is PutStatus.STORED
    assert tier.stats().chunks == 1


def test_on_evict_failure_is_counted_and_the_put_still_succeeds(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=1)

    def boom(key: ChunkKey, header: RecordHeader, read: Callable[[], bytes | None]) -> None:
        raise RuntimeError("lower tier down")

    tier.on_evict = boom
    tier.put(*pages_record(1, 1))
    assert tier.put(*pages_record(2, 1)) is PutStatus.STORED
    assert tier.stats().errors == 1


def test_put_decodes_compressed_records_and_rejects_wrong_payload_sizes(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier()
    h, p = record(1, 1000)
    z = encode_payload(p, Codec.ZSTD, 1)
    zh = make_header(
        key=h.key,
        parent=ROOT,
        fingerprint=FP,
        token_bytes=h.token_bytes,
        dtype="uint8",
        shape=[1000],
        payload=z,
        codec=Codec.ZSTD,
    )
    with pytest.raises(InvalidArgument, match="RAW"):
        tier.reserve(zh)  # clients write raw bytes in place: nothing to decode there
    with pytest.raises(InvalidArgument, match="999"):
        tier.put(h, p[:999])
    assert tier.put(zh, z) is PutStatus.STORED, "L1 decodes a compressed record once, on put"
    out = bytearray(1000)
    assert tier.get_into(h.key, memoryview(out)) is not None and bytes(out) == p
    assert tier.put(h, p) is PutStatus.EXISTS
    with pytest.raises(InvalidArgument, match="output buffer"):
        tier.get_into(h.key, memoryview(bytearray(10)))
    assert detail(tier, "pages_used") == 1 and tier.get(h.key) is not None, "ref leaked"


# -- corruption ------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["payload", "header"])
@pytest.mark.parametrize("read", ["get", "get_into", "acquire"])
def test_a_flipped_bit_is_a_counted_miss_and_the_chunk_is_deleted(
    make_tier: Callable[..., MemoryTier],
    read: str,
    where: str,
) -> None:
    tier = make_tier(pages=8)
    h, p = record(3, 3 * PAGE)
    assert tier.put(h, p) is PutStatus.STORED
    flip_bit(tier, h.key, HS + 2 * PAGE + 5 if where == "payload" else 40)
    before = tier.stats()
    if read == "get":
        assert tier.get(h.key) is None
    elif read == "get_into":
        assert tier.get_into(h.key, memoryview(bytearray(len(p)))) is None
    else:
        assert tier.acquire(h.key) is None
    s = tier.stats()
    assert (s.corrupt, s.misses - before.misses, s.hits - before.hits) == (1, 1, 0), s
    assert tier.contains([h.key]) == [False], "a corrupt chunk must be deleted"
    assert detail(tier, "pages_used") == 0, "its pages must be freed"


def test_damage_two_readers_find_at_once_is_counted_once(
    make_tier: Callable[..., MemoryTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two readers check the same damaged chunk at the same time (the write-down's copy
    and a client's read, seen in CI): one damaged record, one ``corrupt``, one report,
    both reads a miss and the pages freed once both are done."""
    tier = make_tier(pages=8)
    h, p = record(4, 3 * PAGE)
    assert tier.put(h, p) is PutStatus.STORED
    flip_bit(tier, h.key, HS + PAGE + 9)
    reported: list[ChunkKey] = []
    tier.on_corrupt = reported.append
    real = MemoryTier._blob_ok
    second: list[bytes | None] = []
    calls = itertools.count()

    def racing(self: MemoryTier, entry: object, blob: bytes) -> bool:
        if next(calls) == 0:  # the first reader is still checking: a second one reads it too
            second.append(tier.get(h.key))
        return real(self, entry, blob)  # type: ignore[arg-type]

    monkeypatch.setattr(MemoryTier, "_blob_ok", racing)
    assert tier.get(h.key) is None and second == [None], "damaged bytes were served"
    s = tier.stats()
    assert s.corrupt == 1, f"one damaged chunk counted {s.corrupt} times"
    assert reported == [h.key], f"reported {len(reported)} times"
    assert tier.contains([h.key]) == [False] and detail(tier, "pages_used") == 0


def test_a_corrupt_chunk_is_not_pushed_down_on_eviction(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=1)
    evicted: list[ChunkKey] = []
    tier.on_evict = lambda k, h, read: evicted.append(k) if read() is not None else None
    h, p = pages_record(1, 1)
    tier.put(h, p)
    flip_bit(tier, h.key, HS + 100)
    assert tier.put(*pages_record(2, 1)) is PutStatus.STORED
    assert evicted == [] and tier.stats().corrupt == 1, "the reader must refuse damaged bytes"


def test_an_evicted_chunk_is_read_only_if_its_evictor_asks(
    make_tier: Callable[..., MemoryTier],
) -> None:
    """A chunk already kept below (written through) is evicted without a copy or a hash of
    its bytes: damage nobody reads is not even found."""
    tier = make_tier(pages=1)
    evicted: list[ChunkKey] = []
    tier.on_evict = lambda k, h, read: evicted.append(k)
    h, p = pages_record(1, 1)
    tier.put(h, p)
    flip_bit(tier, h.key, HS + 100)
    assert tier.put(*pages_record(2, 1)) is PutStatus.STORED
    assert evicted == [h.key] and tier.stats().corrupt == 0, "the evicted chunk was read"


# -- reserve / commit ----------------------------------------------------------------------
def test_reserve_commit_publishes_only_verified_bytes(make_tier: Callable[..., MemoryTier]) -> None:
    tier = make_tier(pages=8)
    h, p = record(5, 2 * PAGE)
    res = tier.reserve(h, owner="client-1")
    assert isinstance(res, Reservation)
    assert res.payload_offset == HS and res.record_size == h.record_size
    assert tier.contains([h.key]) == [False], "a reserved key is not visible before commit"
    with ArenaView.open(tier.path, tier.capacity_bytes) as client:
        client.write(res.extents, res.payload_offset, p)
    assert tier.commit(res.id) is PutStatus.STORED
    assert tier.get(h.key) == h.pack() + p
    assert tier.reserve(h) is PutStatus.EXISTS
    with pytest.raises(LeaseError, match="unknown"):
        tier.commit(res.id)


@pytest.mark.parametrize("verify_reads", [True, False], ids=["verify-reads", "no-verify-reads"])
@pytest.mark.parametrize("tamper", ["payload", "header"])
def test_bad_bytes_from_an_untrusted_client_are_never_served(
    make_tier: Callable[..., MemoryTier],
    tamper: str,
    verify_reads: bool,
) -> None:
    """An overwritten header always fails the commit. A payload that does not match its
    checksum fails it when reads are not verified (the commit is then the one check);
    with ``verify_reads`` the commit skips that pass and the first read finds it."""
    tier = make_tier(pages=8, verify_reads=verify_reads)
    h, p = record(6, 5000)
    res = tier.reserve(h)
    assert isinstance(res, Reservation)
    bad = bytearray(p)
    bad[4999] ^= 1
    with ArenaView.open(tier.path) as client:
        client.write(res.extents, HS, bad if tamper == "payload" else p)
        if tamper == "header":
            client.write(res.extents, 8, b"\xff")
    if tamper == "payload" and verify_reads:
        assert tier.commit(res.id) is PutStatus.STORED, "commit should not hash the payload"
        assert tier.get(h.key) is None, "bytes failing their checksum were served"
    else:
        with pytest.raises(CorruptRecord):
            tier.commit(res.id)
    s = tier.stats()
    assert (s.corrupt, s.chunks, detail(tier, "pages_used")) == (1, 0, 0), s
    assert tier.contains([h.key]) == [False]


@pytest.mark.parametrize("tamper", ["clean", "header", "payload", "no-checksum"])
def test_checksum_at_commit_seals_the_record_with_the_writers_checksum(
    make_tier: Callable[..., MemoryTier],
    tamper: str,
) -> None:
    """A writer that could not hash before writing (a device copy into the arena) gives
    the checksum at commit: the header is sealed with it, and the pages are checked
    against it (at commit with ``verify_reads`` off, by their first read with it on), so a
    stray write into them before the commit is caught."""
    tier = make_tier(pages=8, verify_reads=tamper != "payload")
    h, p = record(10, 2 * PAGE + 100)
    res = tier.reserve(replace(h, payload_checksum=0), checksum_at_commit=True)
    assert isinstance(res, Reservation)
    with ArenaView.open(tier.path) as client:
        client.write(res.extents, HS, p)
        if tamper == "header":
            client.write(res.extents, 8, b"\xff")
        if tamper == "payload":  # after the writer hashed what it wrote
            client.write(res.extents, HS + 5000, bytes([p[5000] ^ 1]))
    if tamper == "no-checksum":
        with pytest.raises(InvalidArgument, match="checksum"):
            tier.commit(res.id)
        assert detail(tier, "pages_used") == 0, "a refused commit gives the pages back"
        return
    if tamper != "clean":
        with pytest.raises(CorruptRecord, match=tamper):
            tier.commit(res.id, h.payload_checksum)
        assert (tier.stats().corrupt, detail(tier, "pages_used")) == (1, 0)
        return
    assert tier.commit(res.id, h.payload_checksum) is PutStatus.STORED
    sealed = tier.header(h.key)
    assert sealed is not None and sealed.payload_checksum == h.payload_checksum, (
        "the sealed header must carry the writer's checksum"
    )
    assert tier.get(h.key) == h.pack() + p, "the arena must hold the sealed header"
    flip_bit(tier, h.key, HS + 7)
    assert tier.get(h.key) is None and tier.stats().corrupt == 1, (
        "a sealed record must verify on read like any other"
    )


def test_a_checksum_at_commit_must_match_a_header_that_has_one(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=8)
    h, p = record(11, 3000)
    res = tier.reserve(h)
    assert isinstance(res, Reservation)
    with ArenaView.open(tier.path) as client:
        client.write(res.extents, HS, p)
    with pytest.raises(InvalidArgument, match="differs"):
        tier.commit(res.id, h.payload_checksum ^ 1)
    assert tier.contains([h.key]) == [False] and detail(tier, "pages_used") == 0


def test_racing_reservations_of_one_key_store_it_once(make_tier: Callable[..., MemoryTier]) -> None:
    tier = make_tier(pages=8)
    h, p = record(7, 3000)
    a, b = tier.reserve(h), tier.reserve(h)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    with ArenaView.open(tier.path) as client:
        client.write(a.extents, HS, p)
        client.write(b.extents, HS, p)
    assert tier.commit(a.id) is PutStatus.STORED
    assert tier.commit(b.id) is PutStatus.EXISTS
    assert detail(tier, "pages_used") == 1, "the losing reservation's pages must be freed"
    c = tier.put(*record(8, 10))
    assert c is PutStatus.STORED
    r = tier.reserve(record(9, 10)[0])
    assert isinstance(r, Reservation) and tier.abort(r.id) and not tier.abort(r.id)


# -- leases and expiry --------------------------------------------------------------------
def test_a_client_that_died_holding_leases_does_not_leak_pages(
    make_tier: Callable[..., MemoryTier],
) -> None:
    clock = FakeClock()
    tier = make_tier(pages=4, clock=clock, lease_ms=1000)
    recs = [pages_record(i, 1) for i in range(3)]
    for h, p in recs:
        tier.put(h, p)
    leases = [tier.acquire(h.key, owner="dead") for h, _ in recs]
    assert all(isinstance(x, ReadLease) for x in leases)
    res = tier.reserve(pages_record(9, 1)[0], owner="dead")
    assert isinstance(res, Reservation)
    assert tier.put(*pages_record(10, 1)) is PutStatus.FULL, "everything is leased or reserved"
    clock.advance(1.001)  # nobody calls sweep(): the next allocation must reclaim
    assert tier.put(*pages_record(10, 1)) is PutStatus.STORED
    s = tier.stats()
    assert (s.detail["active_leases"], s.detail["reservations"], s.detail["expired"]) == (0, 0, 4)
    assert s.evictions == 0, "the reservation's page was enough"
    assert leases[0] is not None and tier.release(leases[0].id) is False, (
        "releasing an expired lease must say the pages were not protected"
    )
    with pytest.raises(LeaseError, match="unknown"):
        tier.commit(res.id)


def test_sweep_renew_and_expired_commit(make_tier: Callable[..., MemoryTier]) -> None:
    clock = FakeClock()
    tier = make_tier(pages=4, clock=clock, lease_ms=1000)
    h, p = pages_record(1, 1)
    tier.put(h, p)
    lease = tier.acquire(h.key)
    res = tier.reserve(pages_record(2, 1)[0])
    assert lease is not None and isinstance(res, Reservation)
    assert lease.expires_at == res.expires_at == clock.now + 1.0
    clock.advance(0.9)
    assert tier.renew(lease.id), "a live lease can be renewed"
    clock.advance(0.2)
    assert tier.sweep() == 1, "only the unrenewed reservation has expired"
    assert detail(tier, "pages_used") == 1
    with pytest.raises(LeaseError):
        tier.commit(res.id)
    res2 = tier.reserve(pages_record(3, 1)[0])
    assert isinstance(res2, Reservation)
    clock.advance(5)
    with pytest.raises(LeaseError, match="expired"):
        tier.commit(res2.id)  # expired but not yet swept
    assert not tier.renew(lease.id) and tier.sweep() == 0
    assert detail(tier, "pages_used") == 1 and detail(tier, "active_leases") == 0


def test_renew_and_release_owner_touch_only_that_owners_holds(
    make_tier: Callable[..., MemoryTier],
) -> None:
    clock = FakeClock()
    tier = make_tier(pages=8, clock=clock, lease_ms=1000)
    h, p = pages_record(1, 1)
    tier.put(h, p)
    mine = [tier.acquire(h.key, owner="a"), tier.acquire(h.key, owner="a")]
    theirs = tier.acquire(h.key, owner="b")
    clock.advance(0.5)
    tier.reserve(pages_record(2, 2)[0], owner="a")
    clock.advance(0.4)
    assert tier.renew_owner("a") == 3, "a session ping renews the owner's leases"
    clock.advance(0.2)
    assert tier.sweep() == 1, "only b's unrenewed lease expired"
    assert theirs is not None and not tier.release(theirs.id)
    assert tier.release_owner("a") == 3
    assert detail(tier, "pages_used") == 1 and detail(tier, "active_leases") == 0
    assert all(x is not None and not tier.release(x.id) for x in mine)


def test_delete_while_leased_frees_pages_on_release(make_tier: Callable[..., MemoryTier]) -> None:
    tier = make_tier(pages=2)
    h, p = pages_record(1, 2)
    tier.put(h, p)
    lease = tier.acquire(h.key)
    assert lease is not None and tier.delete(h.key)
    assert tier.contains([h.key]) == [False] and tier.get(h.key) is None
    assert tier.put(*pages_record(2, 1)) is PutStatus.FULL, "leased pages must stay put"
    with ArenaView.open(tier.path) as reader:
        assert reader.read(lease.extents, HS, len(p)) == p, "the leased bytes are intact"
    assert detail(tier, "deleted_while_leased") == 1
    assert tier.release(lease.id)
    assert detail(tier, "pages_used") == 0
    assert tier.put(*pages_record(2, 1)) is PutStatus.STORED


# -- another process -----------------------------------------------------------------------
CHILD = r"""
import json, sys
import numpy as np, xxhash
from kvstore.arena import ArenaView
a = json.loads(sys.argv[1])
with ArenaView.open(a["path"], a["size"]) as view:
    got = bytearray(a["read_len"])
    view.read_into([tuple(e) for e in a["read_extents"]], a["read_start"], got)
    payload = np.random.default_rng(a["seed"]).integers(0, 256, a["write_len"], dtype=np.uint8)
    view.write([tuple(e) for e in a["write_extents"]], a["write_start"], payload)
print(xxhash.xxh3_64_intdigest(bytes(got)))
"""


def test_another_process_reads_a_lease_and_writes_a_reservation(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=12)
    for i in range(12):
        tier.put(*pages_record(i, 1))
    for i in range(0, 12, 2):
        tier.delete(pages_record(i, 1)[0].key)  # six one-page holes
    src_h, src_p = record(40, 3 * PAGE)  # 4 pages over 4 holes
    assert tier.put(src_h, src_p) is PutStatus.STORED
    lease = tier.acquire(src_h.key, owner="child")
    dst_h, dst_p = record(41, 2 * PAGE - HS)  # the last 2 holes
    res = tier.reserve(dst_h, owner="child")
    assert lease is not None and isinstance(res, Reservation)
    assert (len(lease.extents), len(res.extents)) == (4, 2), "exercise several extents"
    args = {
        "path": tier.path,
        "size": tier.capacity_bytes,
        "seed": 41,
        "read_extents": lease.extents,
        "read_start": lease.payload_offset,
        "read_len": len(src_p),
        "write_extents": res.extents,
        "write_start": res.payload_offset,
        "write_len": len(dst_p),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"child failed: {proc.stderr}"
    assert int(proc.stdout) == xxhash.xxh3_64_intdigest(src_p), "child read other bytes"
    assert tier.release(lease.id)
    assert tier.commit(res.id) is PutStatus.STORED, "the child's bytes must verify"
    out = np.empty(len(dst_p), np.uint8)
    assert tier.get_into(dst_h.key, out.data) == dst_h
    assert out.tobytes() == dst_p


# -- concurrency and stats ------------------------------------------------------------------
def test_concurrent_puts_gets_and_evictions_keep_the_books_straight(
    make_tier: Callable[..., MemoryTier],
) -> None:
    tier = make_tier(pages=16)
    evicted: list[ChunkKey] = []
    tier.on_evict = lambda k, h, read: evicted.append(verify(read(), expect_key=k).key)
    recs = [record(i, (i % 3 + 1) * PAGE - HS) for i in range(60)]
    payloads = {h.key: p for h, p in recs}
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for j in range(120):
                h, p = recs[(offset + j * 7) % len(recs)]
                assert tier.put(h, p).ok
                blob = tier.get(recs[(offset + j) % len(recs)][0].key)
                assert blob is None or blob[HS:] == payloads[verify(blob).key]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k * 13,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s = tier.stats()
    assert s.used_bytes == sum(c.size for c in tier.scan())
    assert s.detail["pages_used"] == sum(-(-c.size // PAGE) for c in tier.scan())
    assert s.detail["active_leases"] == 0 and s.corrupt == 0
    assert len(evicted) == s.evictions > 0


def test_stats_report_pages_fragmentation_and_leases(make_tier: Callable[..., MemoryTier]) -> None:
    tier = make_tier(pages=8)
    h, p = record(1, PAGE)  # 1 page + 256 bytes -> 2 pages
    tier.put(h, p)
    tier.acquire(h.key)
    s = tier.stats()
    assert s.used_bytes == h.record_size, "used_bytes counts record bytes"
    d = s.detail
    assert (d["pages_used"], d["pages_free"], d["free_extents"], d["active_leases"]) == (2, 6, 1, 1)
    (info,) = tier.scan(FP)
    assert info.hits == 1 and info.last_access_ms > 0 and info.size == h.record_size
    assert list(tier.scan(b"\x01" * 16)) == []
    assert tier.clear(FP) == 1 and tier.stats().chunks == 0
