"""One contract suite, run against every tier (kvstore/engine/tiers/base.py states the contract).

Tiers: L1 shared memory, L2 LMDB, L3 Redis, L3 Valkey, L3 Valkey cluster (3 nodes).
Each harness knows how to build its tier with a given capacity and how to damage
one stored record (fault injection is the only place tests reach inside a tier).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore.config import DiskConfig, MemoryConfig, RemoteConfig
from kvstore.engine.tiers.base import Tier
from kvstore.errors import CorruptRecord, StoreClosed
from kvstore.keys import ChunkKey, Namespace
from kvstore.records import Codec, RecordHeader, parse_header, verify
from kvstore.testing.redis import RedisServer, ServerCluster
from kvstore.types import PutStatus
from tests.helpers import FP, make_chain, make_chunk

KiB, MiB = 1 << 10, 1 << 20
BPT = 256  # bytes per token: a 16-token chunk is a ~4.2 KiB record


@dataclass
class Harness:
    name: str
    make: Callable[[int], Tier]  # capacity in bytes -> a new, empty tier
    corrupt: Callable[[Tier, ChunkKey], None]
    cleanup: Callable[[], None] = lambda: None


def _flip_memory(tier: Tier, key: ChunkKey) -> None:
    from kvstore.arena import ArenaView

    lease = tier.acquire(key)  # type: ignore[attr-defined]
    assert lease is not None
    off, length = lease.extents[-1]
    tier.release(lease.id)  # type: ignore[attr-defined]
    view = ArenaView.open(tier.path)  # type: ignore[attr-defined]
    try:
        view.array[off + length - 1] ^= 0xFF
    finally:
        view.close()


def _flip_disk(tier: Tier, key: ChunkKey) -> None:
    env, db = tier._env, tier._records  # type: ignore[attr-defined]
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(key))
        value[-1] ^= 0xFF
        txn.put(key, bytes(value))


def _remote_harness(
    name: str, url: str, raw: Callable[[], Any], cleanup: Callable[[], None]
) -> Harness:
    counter = iter(range(10**6))

    def make(capacity: int) -> Tier:
        from kvstore.engine.tiers.remote import RemoteTier

        # A fresh prefix per tier: tests share the server but never each other's keys.
        cfg = RemoteConfig(
            url=url,
            capacity_bytes=capacity,
            prefix=f"t{next(counter)}",
            codec="raw",
            timeout_ms=2000,
        )
        return RemoteTier(cfg)

    def corrupt(tier: Tier, key: ChunkKey) -> None:
        client = raw()
        name = tier._c(key)  # type: ignore[attr-defined]
        value = bytearray(client.get(name))
        value[-1] ^= 0xFF
        client.set(name, bytes(value))

    return Harness(name, make, corrupt, cleanup)


def _harness(kind: str) -> Harness:
    if kind == "memory":
        from kvstore.engine.tiers.memory import MemoryTier

        return Harness(
            kind,
            lambda cap: MemoryTier(MemoryConfig(capacity_bytes=cap, page_bytes=4 * KiB)),
            _flip_memory,
        )
    if kind == "disk":
        from kvstore.engine.tiers.disk import DiskTier

        root = Path(tempfile.mkdtemp(prefix="kvs-contract-"))
        n = iter(range(10**6))
        return Harness(
            kind,
            lambda cap: DiskTier(
                DiskConfig(capacity_bytes=max(cap, MiB)), str(root / str(next(n)))
            ),
            _flip_disk,
        )
    if kind in ("redis", "valkey"):
        import redis

        server = RedisServer(kind)
        return _remote_harness(
            kind, server.url, lambda: redis.Redis(port=server.port), server.close
        )
    if kind == "valkey-cluster":
        import redis

        cluster = ServerCluster(3, "valkey")
        node = cluster.nodes[0]
        return _remote_harness(
            kind,
            cluster.url,
            lambda: redis.RedisCluster(host="127.0.0.1", port=node.port),
            cluster.close,
        )
    raise AssertionError(kind)


KINDS = ["memory", "disk", "redis", "valkey", "valkey-cluster"]


@pytest.fixture(scope="module", params=KINDS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = _harness(request.param)
    yield h
    h.cleanup()


@pytest.fixture
def tier(harness: Harness) -> Iterator[Tier]:
    t = harness.make(4 * MiB)
    yield t
    t.close()


def capacity_for(harness: Harness, records: int) -> int:
    """Capacity that holds about ``records`` test records (disk has a 1 MiB floor)."""
    if harness.name == "disk":
        return MiB
    return records * 4608


def n_for(harness: Harness) -> int:
    """How many records overflow ``capacity_for(harness, 8)``."""
    return 300 if harness.name == "disk" else 16


def test_put_get_round_trip(tier: Tier) -> None:
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    assert tier.put(header, payload) == PutStatus.STORED
    blob = tier.get(header.key)
    assert blob is not None, "a stored record must be found"
    h = verify(blob, expect_key=header.key)
    assert (h.parent, h.fingerprint, h.token_bytes, h.shape) == (
        header.parent,
        header.fingerprint,
        header.token_bytes,
        header.shape,
    )
    out = bytearray(len(payload))
    got = tier.get_into(header.key, memoryview(out))
    assert got is not None and bytes(out) == payload, "get_into must deliver the raw payload"


def test_a_whole_record_is_stored_as_put_would(tier: Tier) -> None:
    """put_record (what the store's write-down hands a tier: the record as get returns
    it) stores what put would: get returns a record of the same key and payload, and a
    second one of the key is EXISTS, whichever way each came."""
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    record = header.pack() + bytes(payload)
    assert tier.put_record(header, record) == PutStatus.STORED
    blob = tier.get(header.key)
    assert blob is not None, "a record stored whole must be found"
    h = verify(blob, expect_key=header.key)
    assert bytes(memoryview(blob)[h.header_size :]) == bytes(payload), "another payload came back"
    assert tier.put(header, payload) == PutStatus.EXISTS
    assert tier.put_record(header, record) == PutStatus.EXISTS


def test_put_existing_key_is_exists(tier: Tier) -> None:
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    assert tier.put(header, payload) == PutStatus.STORED
    assert tier.put(header, payload) == PutStatus.EXISTS


def test_miss_is_none_and_counted(tier: Tier) -> None:
    before = tier.stats().misses
    assert tier.get(ChunkKey(b"\x07" * 32)) is None
    assert tier.get_into(ChunkKey(b"\x07" * 32), memoryview(bytearray(16))) is None
    assert tier.stats().misses > before


def test_contains_batched(tier: Tier) -> None:
    chain = make_chain(list(range(64)), 16, bytes_per_token=BPT)
    for header, payload in chain[:2]:
        tier.put(header, payload)
    keys = [h.key for h, _ in chain]
    assert tier.contains(keys) == [True, True, False, False]
    assert tier.contains([]) == []


def test_delete(tier: Tier) -> None:
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    tier.put(header, payload)
    assert tier.delete(header.key) is True
    assert tier.delete(header.key) is False
    assert tier.get(header.key) is None and tier.contains([header.key]) == [False]


def test_clear_per_namespace(tier: Tier) -> None:
    other = Namespace(model="someone-else").fingerprint
    mine = make_chain(list(range(48)), 16, bytes_per_token=BPT)
    theirs = make_chain(list(range(48)), 16, fp=other, bytes_per_token=BPT)
    for h, p in mine + theirs:
        tier.put(h, p)
    assert tier.clear(other) == 3
    assert tier.contains([h.key for h, _ in theirs]) == [False] * 3
    assert tier.contains([h.key for h, _ in mine]) == [True] * 3
    assert {i.key for i in tier.scan(FP)} == {h.key for h, _ in mine}
    assert tier.clear() == 3 and list(tier.scan()) == []


def test_scan_reports_headers(tier: Tier) -> None:
    chain = make_chain(list(range(40)), 16, bytes_per_token=BPT)
    for h, p in chain:
        tier.put(h, p)
    infos = {i.key: i for i in tier.scan()}
    assert set(infos) == {h.key for h, _ in chain}
    for h, _ in chain:
        assert infos[h.key].header.token_bytes == h.token_bytes and infos[h.key].size > 0


def test_lru_eviction_hands_chunks_over(harness: Harness) -> None:
    tier = harness.make(capacity_for(harness, 8))
    evicted: list[ChunkKey] = []

    def on_evict(key: ChunkKey, header: Any, read: Callable[[], bytes | None]) -> None:
        blob = read()
        assert blob is not None, "an intact chunk's reader returned nothing"
        verify(blob, expect_key=key)  # what is handed over must be a whole, valid record
        evicted.append(key)

    tier.on_evict = on_evict
    try:
        n = n_for(harness)
        chain = make_chain(list(range(16 * n)), 16, bytes_per_token=BPT)
        statuses = [tier.put(h, p) for h, p in chain]
        assert all(s == PutStatus.STORED for s in statuses), statuses
        assert evicted, "over capacity, the tier must evict"
        assert evicted[0] == chain[0][0].key, "least recently used goes first"
        assert tier.stats().evictions >= len(evicted)
        assert tier.stats().used_bytes <= tier.stats().capacity_bytes
        assert tier.contains([chain[-1][0].key]) == [True], "the newest chunk must be there"
    finally:
        tier.close()


def test_recently_read_survives_eviction(harness: Harness) -> None:
    tier = harness.make(capacity_for(harness, 8))
    try:
        n = n_for(harness)
        chain = make_chain(list(range(16 * n)), 16, bytes_per_token=BPT)
        first = chain[0]
        tier.put(*first)
        for i, (h, p) in enumerate(chain[1:]):
            if i % 3 == 0:
                assert tier.get(first[0].key) is not None, "read keeps it recent"
            tier.put(h, p)
        assert tier.contains([first[0].key]) == [True], "LRU, not FIFO: a hot chunk stays"
    finally:
        tier.close()


def test_pinned_never_evicted_and_full(harness: Harness) -> None:
    tier = harness.make(capacity_for(harness, 8))
    try:
        n = n_for(harness)
        chain = make_chain(list(range(16 * n)), 16, bytes_per_token=BPT)
        statuses = []
        for h, p in chain:
            st = tier.put(h, p)
            statuses.append(st)
            if st == PutStatus.STORED:
                assert tier.pin(h.key) is True
        assert PutStatus.FULL in statuses, "with everything pinned, a put must report FULL"
        stored = [
            h.key for (h, _), st in zip(chain, statuses, strict=True) if st == PutStatus.STORED
        ]
        assert all(tier.contains(stored)), "a pinned chunk was evicted"
        assert tier.pin(ChunkKey(b"\x09" * 32)) is False
        tier.pin(stored[0], False)
        h, p = make_chunk(range(9000, 9016), bytes_per_token=BPT)
        assert tier.put(h, p) == PutStatus.STORED, "unpinning makes room again"
    finally:
        tier.close()


def test_too_large(harness: Harness) -> None:
    tier = harness.make(capacity_for(harness, 2))
    try:
        h, p = make_chunk(
            range(16), bytes_per_token=(2 * MiB if harness.name == "disk" else 64 * KiB) // 16
        )
        assert tier.put(h, p) == PutStatus.TOO_LARGE
        assert tier.stats().rejected >= 1
    finally:
        tier.close()


def test_corrupt_record_is_counted_deleted_miss(harness: Harness, tier: Tier) -> None:
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    tier.put(header, payload)
    reported: list[ChunkKey] = []
    tier.on_corrupt = reported.append
    harness.corrupt(tier, header.key)
    assert tier.get(header.key) is None, "a damaged record must never be returned"
    assert tier.stats().corrupt == 1
    assert tier.contains([header.key]) == [False], "a damaged record must be deleted"
    assert reported == [header.key], "the store must be told (on_corrupt)"
    assert tier.put(header, payload) == PutStatus.STORED, "the key can be stored again"
    assert tier.get(header.key) is not None


def _checked_copy(header: RecordHeader, stored: memoryview) -> bytes:
    """A ``read_with`` reader as the store's promotion is: it verifies what it copies."""
    if xxhash.xxh3_64_intdigest(stored) != header.payload_checksum:
        raise CorruptRecord("payload checksum mismatch")
    return bytes(stored)


def test_read_with_hands_over_the_record(tier: Tier) -> None:
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    seen: list[RecordHeader] = []

    def use(h: RecordHeader, stored: memoryview) -> bytes:
        seen.append(h)
        return _checked_copy(h, stored)

    assert tier.read_with(header.key, use) is None and not seen, "a miss calls nobody"
    assert tier.put(header, payload) == PutStatus.STORED
    assert tier.read_with(header.key, use) == payload, "read_with must hand over the payload"
    assert [h.key for h in seen] == [header.key] and seen[0].codec == Codec.RAW


def test_read_with_a_damaged_record_is_a_counted_deleted_miss(harness: Harness, tier: Tier) -> None:
    """Whether the tier finds the damage (a verified get) or the reader does (the disk
    tier hands over its bytes in place), the record is a miss, counted and deleted."""
    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    tier.put(header, payload)
    harness.corrupt(tier, header.key)
    assert tier.read_with(header.key, _checked_copy) is None, "damaged bytes were handed over"
    assert tier.stats().corrupt == 1
    assert tier.contains([header.key]) == [False], "a damaged record must be deleted"


def test_codecs_accepted(tier: Tier) -> None:
    from kvstore.records import build, transcode

    header, payload = make_chunk(range(16), bytes_per_token=BPT)
    zblob = transcode(build(header, payload), Codec.ZSTD_SHUFFLE)
    zh = parse_header(zblob)
    assert tier.put(zh, memoryview(zblob)[zh.header_size :]).ok
    out = bytearray(len(payload))
    assert tier.get_into(header.key, memoryview(out)) is not None and bytes(out) == payload


def test_stats_and_close(harness: Harness) -> None:
    tier = harness.make(capacity_for(harness, 8))
    h, p = make_chunk(range(16), bytes_per_token=BPT)
    tier.put(h, p)
    s = tier.stats()
    assert s.chunks == 1 and s.used_bytes > 0 and s.healthy and s.name == tier.name
    tier.close()
    tier.stats()  # never raises, even closed
    for call in (
        lambda: tier.get(h.key),
        lambda: tier.put(h, p),
        lambda: tier.contains([h.key]),
        lambda: tier.delete(h.key),
    ):
        with pytest.raises(StoreClosed):
            call()
