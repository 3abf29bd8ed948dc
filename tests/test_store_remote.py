"""TieredStore with a real Redis/Valkey L3: sharing, tiers spanned, a remote that fails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import DiskConfig, MemoryConfig, RemoteConfig, StoreConfig
from kvstore.engine.store import TieredStore
from kvstore.engine.tiers.remote_parts import part_count, part_names, split
from kvstore.records import parse_header
from kvstore.testing.redis import RedisServer
from tests.helpers import FP, make_chain

KiB, MiB = 1 << 10, 1 << 20
C = 16


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with RedisServer(request.param) as s:
        yield s


def make_store(
    tmp: Path,
    url: str,
    *,
    memory: int = 4 * MiB,
    prefix: str = "kvs",
    policy: str = "write-through",
    codec: str = "zstd_shuffle",
    disk: bool = True,
) -> TieredStore:
    return TieredStore(
        StoreConfig(
            data_dir=str(tmp),
            chunk_tokens=C,
            granularity=4,
            write_policy=policy,
            memory=MemoryConfig(capacity_bytes=memory, page_bytes=4 * KiB),
            disk=DiskConfig(capacity_bytes=64 * MiB, enabled=disk),
            remote=RemoteConfig(
                url=url,
                prefix=prefix,
                codec=codec,
                timeout_ms=300,
                connect_timeout_ms=300,
                cooldown_ms=200,
                failure_threshold=1,
                retries=0,
            ),
        )
    )


def test_two_hosts_share_through_the_remote(server: RedisServer, tmp_path: Path) -> None:
    toks = list(range(7000, 7064))
    prefix = f"share{time.monotonic_ns()}"
    with make_store(tmp_path / "a", server.url, prefix=prefix) as a:
        chain = make_chain(toks, C)
        for h, p in chain:
            assert a.put(h, p).ok
        assert a.flush(10)
    with make_store(tmp_path / "b", server.url, prefix=prefix) as b:
        r = b.lookup(FP, toks)
        assert r.matched_tokens == 64 and r.by_tier == {3: 64}, (
            "host B must see host A's chunks in L3"
        )
        blob = b.get(chain[2][0].key)
        assert blob is not None and bytes(blob[parse_header(blob).header_size :]) == chain[2][1]
        assert 1 in b.contains([chain[2][0].key])[0], "a remote hit is promoted into memory"
        # Partial match against a chunk only the remote holds (diverges mid-chunk 3).
        q = toks[:52] + [1, 2, 3, 4, 5, 6, 7, 8]
        r = b.lookup(FP, q)
        assert r.matched_tokens == 52 and r.chunks[-1].partial and r.chunks[-1].tier == 3


def test_prefix_spans_three_tiers(server: RedisServer, tmp_path: Path) -> None:
    toks = list(range(100, 148))
    prefix = f"span{time.monotonic_ns()}"
    chain = make_chain(toks, C)
    with make_store(tmp_path / "w", server.url, prefix=prefix) as w:
        for h, p in chain:
            w.put(h, p)
        w.flush(10)
    with make_store(tmp_path / "r", server.url, prefix=prefix) as s:
        s.disk.put(*chain[1])  # type: ignore[union-attr]
        s.index.add(chain[1][0], 2)
        s.memory.put(*chain[0])
        s.index.add(chain[0][0], 1)
        r = s.lookup(FP, toks)
        assert [c.tier for c in r.chunks] == [1, 2, 3], r
        assert r.matched_tokens == 48


def test_remote_down_keeps_serving_local_tiers(tmp_path: Path) -> None:
    with RedisServer("valkey") as srv:
        toks = list(range(300, 348))
        with make_store(tmp_path, srv.url) as s:
            chain = make_chain(toks, C)
            for h, p in chain[:2]:
                assert s.put(h, p).ok
            s.flush(10)
            srv.stop()
            t0 = time.monotonic()
            assert s.put(*chain[2]).ok, "a put must land in L1 with the remote down"
            r = s.lookup(FP, toks)
            assert r.matched_tokens == 48
            assert s.get(chain[0][0].key) is not None
            assert s.flush(10)
            assert time.monotonic() - t0 < 5, "the remote's deadline must bound every call"
            remote = s.stats().tiers[2]
            assert not remote.healthy, "stats must say the remote is down"
            srv.start()
            time.sleep(0.3)  # the breaker's cooldown (200 ms) on the real clock
            s.remote.contains([chain[0][0].key])  # type: ignore[union-attr]
            assert s.stats().tiers[2].healthy, "the remote must be used again once it is back"
            # The chunk put during the outage reaches the remote once it is back.
            assert 3 not in s.contains([chain[2][0].key])[0]
            assert s.stats().tiers[2].detail["backlog"] == 1, "stats must show the copy waiting"
            assert s.retry_remote() == 1, "the copy refused during the outage must be retried"
            assert s.flush(10)
            assert 3 in s.contains([chain[2][0].key])[0], "the outage's chunk is not in L3"
            assert s.stats().tiers[2].detail["backlog"] == 0


def test_copies_refused_while_the_remote_was_down_catch_up(tmp_path: Path) -> None:
    """Chunks stored during an outage reach the remote after it, without a call to
    retry_remote: the next successful copy catches up, even for chunks evicted to L2."""
    with RedisServer("redis") as srv:
        toks = list(range(900, 900 + 16 * 40))
        chain = make_chain(toks, C, bytes_per_token=1024)  # 16 KiB chunks, 640 KiB in all
        with make_store(tmp_path, srv.url, memory=256 * KiB) as s:
            srv.stop()
            for h, p in chain[:-1]:
                assert s.put(h, p).ok
            assert s.flush(10)
            srv.start()
            time.sleep(0.3)  # the breaker's cooldown
            assert s.put(*chain[-1]).ok
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s.flush(10)
                held = [3 in t for t in s.contains([h.key for h, _ in chain])]
                if all(held):
                    break
                s.put(*chain[-1])  # each copy that succeeds catches up 64 more
                time.sleep(0.05)
            missing = [i for i, ok in enumerate(held) if not ok]
            assert not missing, f"chunks stored during the outage never reached L3: {missing}"
            tiers = s.stats().tiers
            assert tiers[0].evictions > 0, "the test needs L1 evictions (chunks only in L2)"


def test_unreachable_remote_at_start(tmp_path: Path) -> None:
    from kvstore.testing.ports import free_port

    with make_store(tmp_path, f"redis://127.0.0.1:{free_port()}") as s:
        chain = make_chain(list(range(32)), C)
        for h, p in chain:
            assert s.put(h, p).ok
        assert s.lookup(FP, list(range(32))).matched_tokens == 32
        assert not s.stats().tiers[2].healthy


@pytest.mark.parametrize(
    ("chunk_kib", "n", "hot"), [(512, 8, 3), (2304, 6, 2)], ids=["whole", "in-parts"]
)
@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_server_side_eviction_shortens_prefixes_and_reads_miss(
    flavor: str, chunk_kib: int, n: int, hot: int, tmp_path: Path
) -> None:
    """Redis/Valkey with maxmemory and allkeys-lru evicts chunks behind kvstore's back:
    another host's lookup stops at the first hole and reports the prefix before it, and
    every read is a verified hit or a miss, never an error (a record in parts that lost a
    part is a counted, deleted miss)."""
    args = ["--maxmemory", "24mb", "--maxmemory-policy", "allkeys-lru"]
    args += ["--maxmemory-samples", "64"]  # near-exact LRU: the hot head of the chain stays
    chunk = chunk_kib * KiB  # the chain fits in 24 MB: nothing is evicted before it is old
    toks = list(range(5000, 5000 + C * n))
    chain = make_chain(toks, C, bytes_per_token=chunk // C)
    parts = part_count(chain[0][0]) if split(chain[0][0]) else 0  # the codec is raw
    with RedisServer(flavor, args=args) as srv:
        raw = _plain(srv)

        def present() -> list[bool]:
            """Which records are there: what a lookup sees (a manifest, for one in parts)."""
            return [bool(raw.exists(f"kvs:c:{h.key.hex()}")) for h, _ in chain]

        def whole(held: list[bool]) -> list[bool]:
            """Of the records ``present()`` found, which are there with every part."""
            return [
                there and (not parts or raw.exists(*part_names("kvs", h.key, parts)) == parts)
                for (h, _), there in zip(chain, held, strict=True)
            ]

        with make_store(tmp_path / "a", srv.url, memory=256 * MiB, codec="raw") as a:
            assert a.remote is not None
            for h, p in chain:
                assert a.put(h, p).ok
            assert a.flush(10)
            time.sleep(1.1)  # the server's LRU clock ticks once a second: the chain is older
            # Other chunks fill the server while the chain's head keeps being read: the
            # server evicts the chain's cold tail, a hole after the hot head. Filling stops
            # at the first key of the chain evicted, a part included: the cold tail is then
            # gone in part at most, and the hot head, read in the same second as the
            # fillers, is not the next in the server's LRU order.
            for i in range(64):
                if not all(whole(present())):
                    break
                for h, _ in chain[:hot]:
                    assert a.remote.get(h.key) is not None, "the hot head was evicted"
                filler = make_chain(list(range(90_000 + i * C, 90_000 + (i + 1) * C)), C,
                                    bytes_per_token=chunk // C)  # fmt: skip
                assert a.put(*filler[0]).ok
                assert a.flush(10)
        held = present()
        complete = whole(held)
        raw.close()
        assert not all(complete), "the server never evicted any of the chain"
        assert all(complete[:hot]), f"the server evicted the hot head: {complete}"
        run = held.index(False) if not all(held) else n  # a record whose parts went is listed
        with make_store(tmp_path / "b", srv.url, memory=256 * MiB, codec="raw", disk=False) as b:
            r = b.lookup(FP, toks)
            assert r.matched_tokens == run * C, (
                f"lookup reports {r.matched_tokens} tokens; the first hole is chunk {run} ({held})"
            )
            served = 0
            for (h, p), there in zip(chain, held, strict=True):
                blob = b.get(h.key)  # must not raise, whatever the server dropped
                if blob is None:
                    continue
                assert there, f"chunk {h.key.hex()[:12]} served although it was evicted"
                assert bytes(blob[parse_header(blob).header_size :]) == p, "other bytes served"
                served += 1
            remote = b.stats().tiers[-1]
            assert served + remote.detail["torn"] == sum(held), remote.detail
            assert remote.corrupt == 0, "an evicted part must not count as corrupt"


def _plain(srv: RedisServer) -> Any:
    if srv.flavor == "valkey":
        import valkey

        return valkey.Valkey(port=srv.port)
    import redis

    return redis.Redis(port=srv.port)


def test_no_presence_filter_with_a_shared_tier(tmp_path: Path, server: RedisServer) -> None:
    """Another host's chunks in L3 match here without ever being in this index, so a
    clear bit would not mean "nothing stored": the store offers no filter."""
    with make_store(tmp_path, server.url) as s:
        assert s.presence() is None
