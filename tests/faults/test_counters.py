"""Each counter pinned to a known sequence of calls (issue 16, item 12).

Operators read hit rates from these counters, so the store's own reads (the
write-down copying a chunk out of L1, the lease on a chunk just promoted) are
counted apart from clients' reads, and a request looked up twice (an engine's
scheduler, then its worker) is counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kvstore
from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.store import TieredStore
from kvstore.testing.server import KVServer
from tests.helpers import FP, make_chain
from tests.server.helpers import namespace, put_chain, tokens

KiB, MiB = 1 << 10, 1 << 20


def test_store_counters_follow_a_known_sequence(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(
            data_dir=str(tmp_path),
            chunk_tokens=16,
            granularity=4,
            memory=MemoryConfig(capacity_bytes=4 * MiB, page_bytes=4 * KiB),
            disk=DiskConfig(capacity_bytes=64 * MiB),
        )
    )
    try:
        chain = make_chain(list(range(64)), 16, bytes_per_token=64)  # 4 chunks of 1 KiB
        for header, payload in chain:
            assert store.put(header, payload).ok
        assert store.flush(10), "write-downs did not finish"
        mem = store.stats().tiers[0]
        # Four puts, each copied down to LMDB by reading it back out of L1.
        assert (mem.puts, mem.hits, mem.misses, mem.bytes_out) == (4, 0, 0, 0), mem
        assert mem.detail["internal_reads"] == 4, mem.detail
        size = chain[0][0].record_size
        assert mem.detail["internal_bytes_out"] == 4 * size, mem.detail

        key0 = chain[0][0].key
        assert store.get(key0) is not None  # an L1 hit
        assert store.get(b"\x01" * 32) is None  # a miss everywhere  # type: ignore[arg-type]
        store.memory.delete(key0)  # gone from L1, still on disk
        lease = store.acquire(key0)  # L1 miss, L2 hit, promoted, leased
        assert lease is not None
        store.release(lease.id)
        s = store.stats()
        mem, disk = s.tiers[0], s.tiers[1]
        assert (s.gets, s.hits) == (3, 2), s
        # One L1 miss: the acquire (its read below no longer asks L1 a second time).
        assert (mem.hits, mem.misses) == (1, 1), f"L1 counts a promoted lease once: {mem}"
        assert mem.bytes_out == size, mem
        assert (disk.hits, disk.misses) == (1, 0), disk

        toks = list(range(64))
        store.lookup(FP, toks)
        store.lookup(FP, toks, count=False)  # the worker repeating its scheduler's lookup
        store.lookup(FP, toks[:32])
        s = store.stats()
        assert s.lookups == 2, f"a repeat was counted again: {s.lookups} lookups"
        assert (s.lookup_tokens, s.matched_tokens) == (64 + 32, 64 + 32), s
    finally:
        store.close()


def test_server_counts_a_repeated_lookup_once(make_server: Callable[..., KVServer]) -> None:
    srv = make_server("counts", args=["--no-disk", "--chunk-tokens", "16"]).start()
    ns = namespace("counts", 64)
    with kvstore.Client(srv.unix_url, shm=False) as c:
        put_chain(c, ns, tokens(32), 16, 64)
        first = c.lookup(ns, tokens(32))
        again = c.lookup(ns, tokens(32), repeat=True)
        st = c.stats()
    assert first.matched_tokens == again.matched_tokens == 32, (first, again)
    assert st.lookups == 1, f"the repeated lookup was counted: {st.lookups}"
    assert srv.stop() == 0, srv.log()
