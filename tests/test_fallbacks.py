"""One decision per fallback (issue 12, item 6): with L1 full, a chunk is offered to L1
once and read from the tier below once, whatever the calls that follow."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.store import TieredStore
from kvstore.types import PutStatus
from tests.helpers import make_chunk

KiB, MiB = 1 << 10, 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _full_store(tmp: Path, clock: Clock) -> tuple[TieredStore, list]:  # type: ignore[type-arg]
    """16 pages of 4 KiB, every one held by a pinned 4-page chunk."""
    store = TieredStore(
        StoreConfig(
            data_dir=str(tmp),
            chunk_tokens=16,
            granularity=4,
            memory=MemoryConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB),
            disk=DiskConfig(capacity_bytes=64 * MiB),
        ),
        clock=clock,
    )
    pinned = []
    for i in range(4):
        h, p = make_chunk(range(1000 * i, 1000 * i + 16), bytes_per_token=800)
        assert store.put(h, p) == PutStatus.STORED
        assert store.pin(h.key)
        pinned.append(h)
    assert store.flush(10)
    return store, pinned


def test_an_l2_hit_with_l1_full_is_read_once(tmp_path: Path) -> None:
    clock = Clock()
    store, _ = _full_store(tmp_path, clock)
    try:
        h, p = make_chunk(range(50_000, 50_016), bytes_per_token=800)
        assert store.put(h, p).ok  # L1 is full: straight to L2
        clock.t += 10  # long after: the next read decides afresh
        mem0, disk0 = store.stats().tiers[0], store.stats().tiers[1]
        # A same-host client's Acquire, then the Get it falls back to (use_get).
        assert store.acquire(h.key) is None
        got = store.read(h.key)
        assert isinstance(got, bytes) and got.endswith(p), "the Get serves the chunk's bytes"
        mem, disk = store.stats().tiers[0], store.stats().tiers[1]
        assert disk.hits - disk0.hits == 1, f"LMDB read {disk.hits - disk0.hits} times, not once"
        assert mem.rejected - mem0.rejected == 1, (
            f"L1 was offered the chunk {mem.rejected - mem0.rejected} times, not once"
        )
        assert mem.detail["fallback_served"] == 1, mem.detail
        # Once the moment has passed, the next read decides again (and reads again).
        clock.t += 10
        assert isinstance(store.read(h.key), bytes)
        assert store.stats().tiers[1].hits - disk0.hits == 2
    finally:
        store.close()


def test_a_full_chunk_is_offered_to_l1_once(tmp_path: Path) -> None:
    clock = Clock()
    store, _ = _full_store(tmp_path, clock)
    try:
        h, p = make_chunk(range(60_000, 60_016), bytes_per_token=800)
        rejected0 = store.stats().tiers[0].rejected
        # A same-host client's Reserve (FULL), then the Put stream it falls back to.
        assert store.reserve(h) == PutStatus.FULL
        assert store.put(h, p) == PutStatus.STORED
        assert store.stats().tiers[0].rejected - rejected0 == 1
        assert 2 in store.contains([h.key])[0], "stored in L2"
        blob = store.get(h.key)
        assert blob is not None and blob.endswith(p)
        # A deleted chunk is not served from what the fallback kept.
        assert store.acquire(h.key) is None
        assert store.delete(h.key)
        assert store.read(h.key) is None and store.get(h.key) is None
    finally:
        store.close()
