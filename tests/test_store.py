"""TieredStore over real tiers: shared memory + LMDB (Redis/Valkey: test_store_remote.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.store import TieredStore
from kvstore.engine.writer import WriteDown
from kvstore.errors import InvalidArgument
from kvstore.keys import ROOT, ChunkKey, Namespace
from kvstore.records import make_header, parse_header
from kvstore.types import PutStatus
from tests.helpers import FP, make_chain, make_chunk

KiB, MiB = 1 << 10, 1 << 20
C = 16  # chunk tokens in these tests


def config(
    tmp: Path,
    *,
    memory: int = 4 * MiB,
    disk: int = 64 * MiB,
    policy: str = "write-through",
    **kw: object,
) -> StoreConfig:
    return StoreConfig(
        data_dir=str(tmp),
        chunk_tokens=C,
        granularity=4,
        write_policy=policy,
        memory=MemoryConfig(capacity_bytes=memory, page_bytes=4 * KiB),
        disk=DiskConfig(capacity_bytes=disk),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = TieredStore(config(tmp_path))
    yield s
    s.close()


def put_chain(store: TieredStore, tokens: list[int], bpt: int = 64) -> list:  # type: ignore[type-arg]
    chain = make_chain(tokens, C, bytes_per_token=bpt)
    for header, payload in chain:
        assert store.put(header, payload).ok
    return chain


def test_put_get_lookup_round_trip(store: TieredStore) -> None:
    toks = list(range(500, 560))
    chain = put_chain(store, toks)
    for header, payload in chain:
        blob = store.get(header.key)
        assert blob is not None, "a chunk just put must be found"
        h = parse_header(blob)
        assert bytes(blob[h.header_size :]) == payload, "bytes differ from what was put"
        out = bytearray(len(payload))
        assert store.get_into(header.key, memoryview(out)) is not None and bytes(out) == payload
    r = store.lookup(FP, toks)
    assert r.matched_tokens == 60 and r.stop == "complete"
    assert store.put(*chain[0]) == PutStatus.EXISTS


def test_write_through_reaches_disk(store: TieredStore) -> None:
    chain = put_chain(store, list(range(64)))
    assert store.flush(10), "write-down did not finish"
    assert all(t == (1, 2) for t in store.contains([h.key for h, _ in chain])), store.contains(
        [h.key for h, _ in chain]
    )
    assert store.stats().tiers[1].chunks == len(chain)


def test_eviction_moves_down_and_get_promotes(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path, memory=64 * KiB, policy="write-back")) as s:
        chain = put_chain(s, list(range(16 * 40)), bpt=256)  # 40 chunks of ~4 KiB + header
        s.flush(10)
        where = s.contains([h.key for h, _ in chain])
        assert all(where), f"write-back eviction must move chunks down, lost: {where.count(())}"
        assert 2 in where[0] and 1 not in where[0], "oldest chunk should have moved to disk"
        assert s.stats().tiers[0].evictions > 0
        blob = s.get(chain[0][0].key)
        assert blob is not None and bytes(blob[parse_header(blob).header_size :]) == chain[0][1]
        assert 1 in s.contains([chain[0][0].key])[0], "a disk hit is promoted into memory"


def test_warm_restart_rebuilds_index(tmp_path: Path) -> None:
    toks = list(range(1000, 1100))
    with TieredStore(config(tmp_path)) as s:
        chain = put_chain(s, toks)
    with TieredStore(config(tmp_path)) as s:
        r = s.lookup(FP, toks)
        assert r.matched_tokens == 100, "chunks committed before a clean close must be found"
        assert r.by_tier == {2: 100}
        blob = s.get(chain[-1][0].key)
        assert blob is not None and bytes(blob[parse_header(blob).header_size :]) == chain[-1][1]


def test_namespace_layout_enforced(store: TieredStore) -> None:
    put_chain(store, list(range(32)))
    h, p = make_chunk(range(900, 916), bytes_per_token=128)
    with pytest.raises(InvalidArgument, match="bytes per token"):
        store.put(h, p)
    tb = h.token_bytes
    bad = make_header(
        key=h.key,
        parent=ROOT,
        fingerprint=FP,
        token_bytes=tb,
        dtype="float16",
        shape=(16, 32),
        payload=p[: 16 * 64],
    )
    with pytest.raises(InvalidArgument, match="dtype"):
        store.put(bad, p[: 16 * 64])


def test_bad_records_rejected(store: TieredStore) -> None:
    h, p = make_chunk(range(16))
    forged = make_header(
        key=h.key,
        parent=ROOT,
        fingerprint=FP,
        token_bytes=h.token_bytes[:-4] + b"\0\0\0\0",
        dtype="bfloat16",
        shape=h.shape,
        payload=p,
    )
    with pytest.raises(InvalidArgument, match="does not match"):
        store.put(forged, p)
    long, lp = make_chunk(range(C * 2))
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        store.put(long, lp)


def test_oversize_for_memory_goes_to_disk(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path, memory=16 * KiB)) as s:
        h, p = make_chunk(range(16), bytes_per_token=4096)  # 64 KiB: larger than the arena
        assert s.put(h, p) == PutStatus.STORED
        assert s.contains([h.key]) == [(2,)]
        assert s.get(h.key) is not None


def test_max_chunk_bytes(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path, max_chunk_bytes=8 * KiB)) as s:
        h, p = make_chunk(range(16), bytes_per_token=1024)
        with pytest.raises(InvalidArgument, match="max_chunk_bytes"):
            s.put(h, p)


def test_delete_clear_pin(store: TieredStore) -> None:
    other = Namespace(model="other").fingerprint
    a = put_chain(store, list(range(48)))
    b = make_chain(list(range(48)), C, fp=other)
    for h, p in b:
        store.put(h, p)
    store.flush(10)
    assert store.delete(a[0][0].key) and not store.delete(a[0][0].key)
    assert store.get(a[0][0].key) is None
    assert store.lookup(FP, list(range(48))).stop == "deleted"
    assert store.clear(other) == 3
    assert store.lookup(other, list(range(48))).matched_tokens == 0
    assert store.lookup(FP, list(range(16, 48))).matched_tokens == 0
    assert store.pin(a[1][0].key) and not store.pin(b"\x01" * 32)  # type: ignore[arg-type]
    assert store.clear() == 2


def test_pinned_chunks_survive_pressure(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path, memory=64 * KiB, policy="write-back")) as s:
        first = put_chain(s, list(range(16)), bpt=256)[0]
        assert s.pin(first[0].key)
        put_chain(s, list(range(5000, 5000 + 16 * 30)), bpt=256)
        assert 1 in s.contains([first[0].key])[0], "a pinned chunk was evicted from memory"


def test_corrupt_disk_record_is_counted_miss(tmp_path: Path) -> None:
    import lmdb

    toks = list(range(64))
    with TieredStore(config(tmp_path)) as s:
        chain = put_chain(s, toks)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, subdir=True)
    db = env.open_db(b"records")
    victim = chain[1][0].key
    with env.begin(write=True, db=db) as txn:
        v = bytearray(txn.get(victim))
        v[-5] ^= 0xFF
        txn.put(victim, bytes(v))
    env.close()
    with TieredStore(config(tmp_path)) as s:
        assert s.get(victim) is None, "a corrupt record must never be returned"
        assert s.stats().tiers[1].corrupt == 1
        r = s.lookup(FP, toks)
        assert r.matched_tokens == 16 and r.stop == "corrupt"


def test_acquire_promotes_from_lmdb_verified_in_one_copy(tmp_path: Path) -> None:
    """An acquire promotes an L2 chunk straight from LMDB's map into L1's pages, checking
    it as it copies: the intact chunks are lent with their bytes, a damaged one is a
    counted miss that leaves nothing in L1 (its pages freed) and is gone from LMDB."""
    import lmdb

    toks = list(range(9000, 9000 + 3 * C))
    with TieredStore(config(tmp_path)) as s:
        chain = put_chain(s, toks, bpt=256)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, subdir=True)
    victim = chain[1][0].key
    with env.begin(write=True, db=env.open_db(b"records")) as txn:
        v = bytearray(txn.get(victim))
        v[-5] ^= 0xFF
        txn.put(victim, bytes(v))
    env.close()
    with TieredStore(config(tmp_path)) as s:
        used0 = s.stats().tiers[0].used_bytes
        assert s.acquire(victim) is None, "a damaged record must never be lent"
        assert s.stats().tiers[1].corrupt == 1
        assert s.contains([victim]) == [()], "the damaged record is gone from every tier"
        assert s.stats().tiers[0].used_bytes == used0, "its L1 pages were freed"
        for header, payload in (chain[0], chain[2]):
            lease = s.acquire(header.key)
            assert lease is not None, "an intact L2 chunk is promoted and lent"
            got = s.arena.read(lease.extents, lease.payload_offset, len(payload))
            assert got == payload, "the promoted chunk holds other bytes than were put"
            s.release(lease.id)
        assert s.contains([chain[0][0].key]) == [(1, 2)]


def test_concurrent_puts_and_reads_are_byte_exact(tmp_path: Path) -> None:
    errors: list[str] = []
    with TieredStore(config(tmp_path, memory=256 * KiB)) as s:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            base = seed * 10_000
            for i in range(30):
                toks = [base + i * 100 + j for j in range(C)]
                h, p = make_chunk(toks, bytes_per_token=256)
                if not s.put(h, p).ok:
                    errors.append(f"put failed {seed}/{i}")
                k = int(rng.integers(0, i + 1))
                hk, pk = make_chunk([base + k * 100 + j for j in range(C)], bytes_per_token=256)
                blob = s.get(hk.key)
                if blob is not None and bytes(blob[parse_header(blob).header_size :]) != pk:
                    errors.append(f"wrong bytes for {seed}/{k}")

        threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.flush(20)
        assert not errors, errors[:5]
        assert s.stats().chunks == 180, "every acknowledged put must be somewhere"


# -- prefetch: promotion into L1 ahead of the reads ----------------------------------------


def _until(cond, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def _idle(s: TieredStore) -> bool:
    return s.stats().tiers[0].detail["prefetch_pending"] == 0


def test_prefetch_promotes_chunks_only_on_disk_into_l1(tmp_path: Path) -> None:
    toks = list(range(3000, 3000 + 8 * C))
    with TieredStore(config(tmp_path)) as s:
        put_chain(s, toks)
    with TieredStore(config(tmp_path)) as s:  # a warm restart: every chunk in L2 only
        r = s.lookup(FP, toks)
        assert r.by_tier == {2: len(toks)}, r.by_tier
        keys = [m.key for m in r.chunks]
        assert s.prefetch(FP, keys) == 8
        _until(lambda: all(1 in w for w in s.contains(keys)), "the chunks to reach L1")
        assert s.lookup(FP, toks).by_tier == {1: len(toks)}, "the lookup now sees them in L1"
        _until(lambda: _idle(s), "the prefetcher to go idle")
        detail = s.stats().tiers[0].detail
        assert detail["prefetch_done"] == 8 and detail["prefetch_failed"] == 0, detail
        assert s.prefetch(FP, keys) == 0, "chunks in L1 are not queued again"
        disk_hits = s.stats().tiers[1].hits
        for key in keys:
            lease = s.acquire(key)
            assert lease is not None, "a prefetched chunk is lent from L1"
            s.release(lease.id)
        assert s.stats().tiers[1].hits == disk_hits, "the reads after the prefetch read LMDB"


def test_prefetch_never_waits_is_deduplicated_and_bounded(tmp_path: Path) -> None:
    """A slow disk (its reads held back) does not hold up the caller; a key asked twice is
    queued once; past a quarter of L1 (bytes queued or running) the rest are dropped."""
    toks = list(range(4000, 4000 + 12 * C))
    cfg = config(tmp_path, memory=64 * KiB)  # budget 16 KiB: 3 chunks of ~4.2 KiB
    with TieredStore(config(tmp_path)) as s:
        put_chain(s, toks, bpt=256)
    with TieredStore(cfg) as s:
        keys = [m.key for m in s.lookup(FP, toks).chunks]
        gate = threading.Event()
        assert s.disk is not None
        read, read_with = s.disk.get, s.disk.read_with

        def slow_get(key: bytes) -> bytes | None:  # fault injection: a disk that stalls
            gate.wait(30)
            return read(key)

        def slow_read_with(key: ChunkKey, use: Any) -> Any:  # (promotions read in place)
            gate.wait(30)
            return read_with(key, use)

        s.disk.get = slow_get  # type: ignore[method-assign]
        s.disk.read_with = slow_read_with  # type: ignore[method-assign]
        t0 = time.monotonic()
        queued = s.prefetch(FP, keys)
        again = s.prefetch(FP, keys[:queued])
        took = time.monotonic() - t0
        detail = s.stats().tiers[0].detail
        gate.set()
        assert took < 1.0, f"prefetch waited {took:.2f} s for a stalled disk"
        assert queued == 3, f"{queued} chunks queued against a 16 KiB budget"
        assert again == 0 and detail["prefetch_skipped"] == 3, "pending keys are queued once"
        assert detail["prefetch_dropped"] == 9, detail
        _until(lambda: _idle(s), "the prefetcher to go idle")
        assert [1 in w for w in s.contains(keys[:3])] == [True] * 3


def test_prefetch_into_a_full_l1_does_not_loop(tmp_path: Path) -> None:
    """L1 full of pinned chunks: the chunk is read from LMDB once and offered to L1 once;
    prefetches of it after that refusal do nothing, and the read that follows is served
    from the record the prefetch kept."""
    now = [1000.0]
    s = TieredStore(
        StoreConfig(
            data_dir=str(tmp_path),
            chunk_tokens=16,
            granularity=4,
            memory=MemoryConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB),
            disk=DiskConfig(capacity_bytes=64 * MiB),
        ),
        clock=lambda: now[0],
    )
    try:
        for i in range(4):  # 4 pinned chunks of 4 pages: every page of L1
            h, p = make_chunk(range(1000 * i, 1000 * i + 16), bytes_per_token=800)
            assert s.put(h, p) == PutStatus.STORED and s.pin(h.key)
        h, p = make_chunk(range(70_000, 70_016), bytes_per_token=800)
        assert s.put(h, p).ok and s.contains([h.key]) == [(2,)]
        assert s.flush(10)
        now[0] += 10  # long after the put L1 refused: the prefetch decides afresh
        mem0, disk0 = s.stats().tiers[0], s.stats().tiers[1]
        assert s.prefetch(FP, [h.key]) == 1
        _until(lambda: _idle(s), "the prefetch to end")
        for _ in range(5):
            s.prefetch(FP, [h.key])
            _until(lambda: _idle(s), "the prefetch to end")
        mem, disk = s.stats().tiers[0], s.stats().tiers[1]
        assert disk.hits - disk0.hits == 1, f"LMDB read {disk.hits - disk0.hits} times"
        assert mem.rejected - mem0.rejected == 1, f"L1 offered {mem.rejected - mem0.rejected}x"
        assert s.contains([h.key]) == [(2,)]
        got = s.read(h.key)
        assert isinstance(got, bytes) and got.endswith(p)
        assert s.stats().tiers[1].hits - disk0.hits == 1, "the read re-read what was kept"
    finally:
        s.close()


# -- write-down: verified, making way for writers --------------------------------------------


def test_write_down_writes_below_only_what_verifies(tmp_path: Path) -> None:
    """The write-down writes a chunk below only if its L1 bytes verify: a byte changed in
    the arena after the commit keeps that chunk out of LMDB (and drops the bad copy)."""
    cfg = config(tmp_path, policy="write-back")  # copied down at close, not at once
    with TieredStore(cfg) as s:
        chain = put_chain(s, list(range(8000, 8000 + 3 * C)), bpt=256)
        bad = chain[1][0].key
        lease = s.acquire(bad)
        assert lease is not None
        off = lease.extents[0][0] + lease.payload_offset + 100
        s.release(lease.id)
        s.arena.array[off] ^= 0xFF  # a rogue writer on the host
    with TieredStore(cfg) as s:
        where = s.contains([h.key for h, _ in chain])
        assert where == [(2,), (), (2,)], f"only the intact chunks reach LMDB: {where}"
        blob = s.get(chain[0][0].key)
        assert blob is not None and blob.endswith(chain[0][1])


def test_evicting_what_is_written_through_reads_no_byte_of_it(tmp_path: Path) -> None:
    """A chunk already in LMDB leaves L1 without its bytes being copied or hashed (with
    write-through, the common eviction): damage to its L1 copy is not even seen, and the
    LMDB copy serves it. One not below yet (write-back) is read, verified, and moved."""
    with TieredStore(config(tmp_path, memory=64 * KiB)) as s:
        chain = put_chain(s, list(range(9000, 9000 + 3 * C)), bpt=256)
        assert s.flush(10)
        lease = s.acquire(chain[0][0].key)
        assert lease is not None
        off = lease.extents[0][0] + lease.payload_offset + 100
        s.release(lease.id)
        s.arena.array[off] ^= 0xFF  # L1's copy damaged; LMDB's is intact
        put_chain(s, list(range(20_000, 20_000 + 16 * 40)), bpt=256)  # evicts the first
        assert s.contains([chain[0][0].key]) == [(2,)], "the damaged chunk should be on disk only"
        assert s.stats().tiers[0].corrupt == 0, "evicting a chunk kept below read its bytes"
        blob = s.get(chain[0][0].key)
        assert blob is not None and blob.endswith(chain[0][1]), "LMDB's copy must serve it"
    with TieredStore(config(tmp_path / "wb", memory=64 * KiB, policy="write-back")) as s:
        chain = put_chain(s, list(range(9000, 9000 + 3 * C)), bpt=256)
        lease = s.acquire(chain[0][0].key)
        assert lease is not None
        off = lease.extents[0][0] + lease.payload_offset + 100
        s.release(lease.id)
        s.arena.array[off] ^= 0xFF
        put_chain(s, list(range(20_000, 20_000 + 16 * 40)), bpt=256)
        s.flush(10)
        assert s.stats().tiers[0].corrupt == 1, "a chunk moved down must be read and verified"
        assert s.contains([chain[0][0].key]) == [()], "a damaged chunk must not move down"
        assert s.contains([chain[1][0].key]) == [(2,)], "an intact one moves down"


def test_write_down_makes_way_for_writers_within_bounds() -> None:
    """While reserves and commits keep coming (``writing``), a queued copy waits for a
    quiet moment, but never past ``max_defer_s``; with a backlog it does not wait."""
    ran: list[float] = []
    wd = WriteDown(lambda job: ran.append(time.monotonic()), 1 << 20, quiet_s=0.2, max_defer_s=5.0)
    try:
        t0 = time.monotonic()
        wd.submit_copy(ChunkKey(b"\x01" * 32), (2,))
        while time.monotonic() - t0 < 0.5:  # a writer busy for half a second
            wd.writing()
            time.sleep(0.005)
        assert wd.flush(10), "the copy never ran"
        assert ran[0] - t0 >= 0.5, f"it ran {ran[0] - t0:.3f} s in, while writes went on"
        assert wd.deferred == 1
        capped = WriteDown(
            lambda job: ran.append(time.monotonic()), 1 << 20, quiet_s=0.5, max_defer_s=0.1
        )
        try:
            t1 = time.monotonic()
            capped.submit_copy(ChunkKey(b"\x02" * 32), (2,))
            while not capped.flush(0) and time.monotonic() - t1 < 10:
                capped.writing()  # never quiet
                time.sleep(0.001)
            assert 0.1 <= ran[1] - t1 < 5, f"capped at max_defer_s: ran {ran[1] - t1:.3f} s in"
        finally:
            capped.stop(5)
        busy = WriteDown(lambda job: ran.append(time.monotonic()), 1 << 20, backlog=2)
        try:
            busy.writing()
            for i in range(3):
                busy.submit_copy(ChunkKey(bytes([i + 3]) * 32), (2,))
            assert busy.flush(10) and busy.deferred <= 1, "a backlog is copied at once"
        finally:
            busy.stop(5)
    finally:
        wd.stop(5)
