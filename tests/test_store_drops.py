"""TieredStore.drop over real tiers (shared memory + LMDB), with an injected clock: a
dropped chunk that someone holds goes when the last hold ends, however it ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.store import TieredStore
from kvstore.keys import ChunkKey
from tests.helpers import FP, make_chain

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def clocked(tmp_path: Path):  # type: ignore[no-untyped-def]
    now = [1000.0]
    s = TieredStore(
        StoreConfig(
            data_dir=str(tmp_path),
            chunk_tokens=16,
            granularity=4,
            memory=MemoryConfig(capacity_bytes=4 * MiB, page_bytes=4 * KiB, lease_ms=1000),
            disk=DiskConfig(capacity_bytes=64 * MiB),
        ),
        clock=lambda: now[0],
    )
    yield s, now
    s.close()


def chunks(store: TieredStore, n: int = 3) -> list[ChunkKey]:
    chain = make_chain(list(range(1000, 1000 + 16 * n)), 16, bytes_per_token=64)
    for header, payload in chain:
        assert store.put(header, payload).ok
    assert store.flush(10), "write-down did not finish"
    keys = [h.key for h, _ in chain]
    assert store.contains(keys) == [(1, 2)] * n, store.contains(keys)
    return keys


def counted(store: TieredStore) -> tuple[int, int]:
    s = store.stats()
    return s.dropped, s.drops_deferred


def test_a_drop_deletes_from_every_tier_or_waits_for_each_kind_of_hold(clocked) -> None:  # type: ignore[no-untyped-def]
    """Free: gone from L1, LMDB and the index at once. Held by a lease that is released,
    by one that expires (the store's upkeep), by an owner that goes away: each stays
    readable until then and goes from every tier at that moment. A key not stored, or
    named twice, counts once or not at all."""
    store, now = clocked
    free, released, expired, owned = chunks(store, 4)
    a = store.acquire(released, owner="a")
    b = store.acquire(expired, owner="b")
    c = store.acquire(owned, owner="c")
    assert a is not None and b is not None and c is not None
    missing = ChunkKey(b"\x0e" * 32)
    assert store.drop([free, free, released, expired, owned, missing]) == (1, 3)
    assert store.contains([free]) == [()]
    assert store.lookup(FP, list(range(1000, 1064))).matched_tokens == 0, "the lookup finds it"
    assert store.contains([released, expired, owned]) == [(1, 2)] * 3, "held chunks must stay"
    assert store.get(released) is not None, "a chunk whose drop waits is still readable"
    assert counted(store) == (1, 3)
    assert store.memory.stats().detail["drops_waiting"] == 3

    assert store.release(a.id) is True
    assert store.contains([released]) == [()], "the last lease ended: gone from every tier"
    now[0] += 1.5  # b's and c's leases expire; only the upkeep notices b's
    assert store.contains([expired]) == [(1, 2)], "nothing has reclaimed b's lease yet"
    store.upkeep()
    assert store.contains([expired, owned]) == [(), ()], "expired leases end the wait too"
    assert counted(store) == (4, 3)


def test_a_pinned_chunk_is_not_dropped(clocked) -> None:  # type: ignore[no-untyped-def]
    """An operator pinned it to keep it: a consumer's drop leaves it (a Delete does not)."""
    store, _ = clocked
    (key,) = chunks(store, 1)
    assert store.pin(key)
    assert store.drop([key]) == (0, 0)
    assert store.contains([key]) == [(1, 2)] and counted(store) == (0, 0)
    assert store.pin(key, False) and store.drop([key]) == (1, 0)
    assert store.contains([key]) == [()]


def test_an_owner_that_goes_and_a_lease_taken_again(clocked) -> None:  # type: ignore[no-untyped-def]
    """A drop waiting for two leases goes when the second ends; one waiting for an owner
    goes with release_owner (a Session that ended); a chunk leased again while its drop
    waits stays until that lease ends too."""
    store, _ = clocked
    k1, k2 = chunks(store, 2)
    x = store.acquire(k1, owner="x")
    assert x is not None and store.acquire(k2, owner="gone") is not None
    assert store.drop([k1, k2]) == (0, 2)
    y = store.acquire(k1, owner="y")  # leased again while the drop waits
    assert y is not None
    assert store.release(x.id) and store.contains([k1]) == [(1, 2)], "y still holds it"
    assert store.release_owner("gone") == 1 and store.contains([k2]) == [()]
    assert store.release(y.id) and store.contains([k1]) == [()]
    assert counted(store) == (2, 2)
