"""RemoteTier against real redis-server and valkey-server processes (standalone and cluster).

Shared servers start once per module (one per backend); every test uses its own
key prefix, so tests never see each other's keys. Tests that stop, pause or
crowd a server get a dedicated one.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import RemoteConfig
from kvstore.engine.tiers.remote import SIBLINGS_ASKED, RemoteTier
from kvstore.engine.tiers.remote_base import filing_fields
from kvstore.engine.tiers.remote_client import parse_url, redact
from kvstore.errors import ConfigError, InvalidArgument, StoreClosed, TierUnavailable
from kvstore.keys import (
    ROOT,
    ChunkKey,
    Fingerprint,
    Namespace,
    chunk_key,
    sub_hashes,
    tokens_to_bytes,
)
from kvstore.records import Codec, RecordHeader, decode_payload, encode, verify
from kvstore.testing.redis import RedisServer, ServerCluster, available, free_port
from kvstore.types import PutStatus

BACKENDS = ["redis", "valkey", "valkey-cluster"]
FP = Namespace("test/model", dtype="float16").fingerprint
FP2 = Namespace("test/other-model", dtype="float16").fingerprint

pytestmark = pytest.mark.skipif(
    not (available("redis") and available("valkey")), reason="redis-server/valkey-server missing"
)


@dataclass
class Backend:
    kind: str
    url: str
    cluster: ServerCluster | None = None
    server: RedisServer | None = None


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    kind = request.param
    if kind == "valkey-cluster":
        with ServerCluster(3, "valkey") as cluster:
            yield Backend(kind, cluster.url, cluster=cluster)
    else:
        with RedisServer(kind) as server:
            yield Backend(kind, server.url, server=server)


@pytest.fixture(params=["redis", "valkey"])
def solo(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server of its own, for tests that stop, pause or reconfigure it."""
    with RedisServer(request.param) as server:
        yield server


def config(url: str, **kw: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(
        url=url,
        prefix=f"t{uuid.uuid4().hex[:10]}",
        timeout_ms=200,
        connect_timeout_ms=200,
        retries=1,
        backoff_ms=5,
        failure_threshold=2,
        cooldown_ms=1000,
        codec="raw",
    )
    base.update(kw)
    return RemoteConfig(**base)


def make_tier(
    url: str, clock: FakeClock | None = None, granularity: int = 16, **kw: Any
) -> RemoteTier:
    return RemoteTier(
        config(url, **kw), clock=clock or FakeClock(), wall=_ticker(), granularity=granularity
    )


def _ticker() -> Any:
    counter = itertools.count(1)
    return lambda: float(next(counter))  # strictly increasing "wall clock": LRU order is exact


def record(
    parent: ChunkKey = ROOT,
    fp: Fingerprint = FP,
    seed: int = 0,
    n_tokens: int = 16,
    width: int = 64,
) -> tuple[RecordHeader, bytes, bytes]:
    """(header, stored payload, raw payload) of a RAW float16 chunk."""
    rng = np.random.default_rng(seed)
    tokens = tokens_to_bytes(rng.integers(0, 50_000, n_tokens))
    raw = rng.integers(0, 64, n_tokens * width, dtype=np.uint16).tobytes()  # compressible
    key = chunk_key(parent, fp, tokens)
    blob = encode(
        key=key,
        parent=parent,
        fingerprint=fp,
        token_bytes=tokens,
        dtype="float16",
        shape=(n_tokens, width),
        payload=raw,
    )
    header = verify(blob)
    return header, blob[header.header_size :], raw


def raw_client(url: str) -> Any:
    """A plain client next to the tier, to damage or inspect values behind its back."""
    flavor, cluster, client_url = parse_url(url)
    if flavor == "redis":
        import redis
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(client_url) if cluster else redis.Redis.from_url(client_url)
    import valkey
    from valkey.cluster import ValkeyCluster

    return ValkeyCluster.from_url(client_url) if cluster else valkey.Valkey.from_url(client_url)


# -- basics -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd_shuffle"])
def test_round_trip_each_codec(backend: Backend, codec: str) -> None:
    with make_tier(backend.url, codec=codec) as tier:
        header, payload, raw = record(seed=1)
        assert tier.put(header, payload) is PutStatus.STORED
        blob = tier.get(header.key)
        assert blob is not None, "a stored chunk must be found"
        got = verify(blob, expect_key=header.key)
        assert got.codec is Codec.parse(codec), f"stored as {got.codec}, tier codec is {codec}"
        assert bytes(decode_payload(got, memoryview(blob)[got.header_size :])) == raw
        out = bytearray(len(raw))
        assert tier.get_into(header.key, memoryview(out)) is not None
        assert bytes(out) == raw, "get_into must hand back the raw payload"
        assert tier.put(header, payload) is PutStatus.EXISTS
        s = tier.stats()
        assert (s.hits, s.puts, s.chunks, s.used_bytes) == (2, 1, 1, len(blob)), s
        assert s.healthy and s.detail["state"] == "closed", s.detail
        assert tier.get(record(seed=2)[0].key) is None
        assert tier.stats().misses == 1


def test_put_transcodes_compressed_input_to_raw(backend: Backend) -> None:
    with make_tier(backend.url, codec="raw") as tier:
        header, _, raw = record(seed=3)
        zblob = encode(
            key=header.key,
            parent=header.parent,
            fingerprint=header.fingerprint,
            token_bytes=header.token_bytes,
            dtype=header.dtype,
            shape=header.shape,
            payload=raw,
            codec=Codec.ZSTD,
        )
        zheader = verify(zblob)
        assert tier.put(zheader, zblob[zheader.header_size :]) is PutStatus.STORED
        blob = tier.get(header.key)
        assert blob is not None and verify(blob).codec is Codec.RAW
        assert blob[verify(blob).header_size :] == raw


def test_contains_is_one_round_trip(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    with make_tier(backend.url) as tier:
        recs = [record(seed=10 + i) for i in range(40)]
        for header, payload, _ in recs[::2]:
            assert tier.put(header, payload) is PutStatus.STORED
        calls: list[str] = []
        real = tier._call

        def counting(op: str, fn: Any, **kw: Any) -> Any:
            calls.append(op)
            return real(op, fn, **kw)

        monkeypatch.setattr(tier, "_call", counting)
        found = tier.contains([h.key for h, _, _ in recs])
        assert found == [i % 2 == 0 for i in range(40)], "presence of each key, in order"
        assert calls == ["contains"], f"contains must be one round trip, made {calls}"
        assert tier.contains([]) == []


def test_children_per_parent_and_namespace(backend: Backend) -> None:
    with make_tier(backend.url) as tier:
        a, pa, _ = record(seed=20)
        b1, p1, _ = record(parent=a.key, seed=21)
        b2, p2, _ = record(parent=a.key, seed=22, n_tokens=8)  # a short last chunk
        other, po, _ = record(fp=FP2, seed=20)  # same tokens, other namespace
        for h, p in ((a, pa), (b1, p1), (b2, p2), (other, po)):
            assert tier.put(h, p) is PutStatus.STORED
        assert tier.children(a.key) == {b1.key: b1.token_bytes, b2.key: b2.token_bytes}
        assert tier.children(ROOT, FP) == {a.key: a.token_bytes}, "ROOT children are per namespace"
        assert tier.children(ROOT, FP2) == {other.key: other.token_bytes}
        with pytest.raises(InvalidArgument):
            tier.children(ROOT)
        assert tier.children(a.key, FP2) == {}, "children never leak across namespaces"
        assert tier.delete(b1.key) is True
        assert tier.delete(b1.key) is False
        assert tier.children(a.key) == {b2.key: b2.token_bytes}, "delete keeps children in sync"
        assert tier.children(b2.key) == {}


def chunk_of(tokens: list[int], parent: ChunkKey = ROOT) -> tuple[RecordHeader, bytes]:
    """A small RAW chunk of these token ids, under ``parent``, in namespace FP."""
    tb = tokens_to_bytes(tokens)
    raw = np.arange(len(tokens) * 4, dtype=np.uint16).tobytes()
    blob = encode(
        key=chunk_key(parent, FP, tb), parent=parent, fingerprint=FP, token_bytes=tb,
        dtype="float16", shape=(len(tokens), 4), payload=raw,
    )  # fmt: skip
    header = verify(blob)
    return header, blob[header.header_size :]


def test_siblings_are_the_few_sharing_the_most_not_the_family(backend: Backend) -> None:
    """ROOT's family holds every first chunk of a namespace: a partial match reads the
    children filed under the query's deepest shared prefix, not all of them (``children``
    read ~1 KiB of token ids per first chunk stored, for every miss)."""
    g = 16
    template = list(range(1000, 1032))  # two units every first chunk below shares
    with make_tier(backend.url, granularity=g) as tier:
        others = [chunk_of([*template, *range(5000 + 32 * i, 5032 + 32 * i)]) for i in range(60)]
        best = chunk_of([*template, *range(9000, 9016), *range(7000, 7016)])
        for h, p in [*others[:30], best, *others[30:]]:
            assert tier.put(h, p) is PutStatus.STORED
        q = sub_hashes(tokens_to_bytes([*template, *range(9000, 9016), *range(1, 17)]), g)
        got = tier.siblings(ROOT, FP, q, g)
        assert best[0].key in got and got[best[0].key] == best[0].token_bytes, got.keys()
        assert len(got) <= SIBLINGS_ASKED, f"read {len(got)} of the family's 61"
        assert len(tier.children(ROOT, FP)) == 61
        assert tier.siblings(ROOT, FP, sub_hashes(best[0].token_bytes, 8), 8) == {}, (
            "filed at 16 tokens a unit: another granularity's fields name nothing"
        )
        assert tier.siblings(ROOT, FP2, q, g) == {}, "per namespace at ROOT"
        assert tier.has_children(ROOT, FP) and not tier.has_children(best[0].key, FP)

        raw = raw_client(backend.url)
        victim = others[59][0]  # the latest put under the template's two units
        raw.delete(tier._c(victim.key))  # gone behind the tier's back (maxmemory, say)
        q2 = sub_hashes(tokens_to_bytes([*template, *range(1, 33)]), g)
        assert tier.siblings(ROOT, FP, q2, g) == {}, "a gone record is never promised"
        assert raw.hget(tier._k(ROOT, FP), victim.key) is None, "and its entry is pruned"
        assert raw.hmget(tier._s(ROOT, FP), filing_fields(q2, g)) == [None] * 4

        assert tier.delete(best[0].key) is True
        assert best[0].key not in tier.siblings(ROOT, FP, q, g), "delete unfiles it"
        assert tier.clear(FP) == 59
        assert not raw.exists(tier._s(ROOT, FP)), "clear drops the filing"


def test_siblings_survive_what_happens_to_others(backend: Backend) -> None:
    """A delete takes only the fields that still name the deleted chunk: a later sibling
    of the same prefix stays filed. Another namespace's chunk under the same parent (a
    writer who knows the parent's key can store one) never takes over this one's."""
    g = 16
    with make_tier(backend.url, granularity=g) as tier:
        parent, pp = chunk_of(list(range(100, 132)))
        older, po = chunk_of([*range(1000, 1032), *range(1, 33)], parent=parent.key)
        later, pl = chunk_of([*range(1000, 1032), *range(40, 72)], parent=parent.key)
        for h, p in ((parent, pp), (older, po), (later, pl)):
            assert tier.put(h, p) is PutStatus.STORED
        q = sub_hashes(tokens_to_bytes([*range(1000, 1032), *range(80, 112)]), g)
        assert set(tier.siblings(parent.key, FP, q, g)) == {later.key}, "the latest is filed"
        assert tier.delete(older.key) is True
        assert set(tier.siblings(parent.key, FP, q, g)) == {later.key}, (
            "deleting the older sibling must leave the fields the later one took over"
        )
        tb = tokens_to_bytes([*range(1000, 1032), *range(80, 112)])
        blob = encode(
            key=chunk_key(parent.key, FP2, tb), parent=parent.key, fingerprint=FP2,
            token_bytes=tb, dtype="float16", shape=(64, 4),
            payload=np.zeros(256, dtype=np.uint16).tobytes(),
        )  # fmt: skip
        intruder = verify(blob)
        assert tier.put(intruder, blob[intruder.header_size :]) is PutStatus.STORED
        assert set(tier.siblings(parent.key, FP, q, g)) == {later.key}, (
            "another namespace's chunk under this parent took over this namespace's fields"
        )
        assert set(tier.siblings(parent.key, FP2, q, g)) == {intruder.key}


def test_clear_per_namespace_and_scan(backend: Backend) -> None:
    with make_tier(backend.url) as tier:
        ours = [record(seed=30 + i) for i in range(3)]
        theirs = [record(fp=FP2, seed=40 + i) for i in range(3)]
        for h, p, _ in ours + theirs:
            assert tier.put(h, p) is PutStatus.STORED
        assert tier.pin(ours[0][0].key) is True
        assert tier.pin(record(seed=99)[0].key) is False, "pinning an absent key"
        infos = {i.key: i for i in tier.scan(FP)}
        assert set(infos) == {h.key for h, _, _ in ours}
        assert infos[ours[0][0].key].pinned and not infos[ours[1][0].key].pinned
        assert all(
            i.header == h and i.size == h.record_size for h, _, _ in ours for i in [infos[h.key]]
        )
        assert len(list(tier.scan())) == 6

        assert tier.clear(FP) == 3
        assert tier.contains([h.key for h, _, _ in ours]) == [False] * 3
        assert tier.contains([h.key for h, _, _ in theirs]) == [True] * 3
        assert list(tier.scan(FP)) == [] and tier.children(ROOT, FP) == {}
        assert len(tier.children(ROOT, FP2)) == 3, "clear(FP) must keep other namespaces' roots"
        s = tier.stats()
        assert s.chunks == 3 and s.used_bytes == sum(h.record_size for h, _, _ in theirs), s
        assert tier.clear() == 3
        assert list(tier.scan()) == []
        s = tier.stats()
        assert (s.chunks, s.used_bytes) == (0, 0), s


def test_scan_skips_and_prunes_records_gone_behind_our_back(backend: Backend) -> None:
    with make_tier(backend.url) as tier:
        recs = [record(seed=55 + i) for i in range(3)]
        for h, p, _ in recs:
            assert tier.put(h, p) is PutStatus.STORED
        client = raw_client(backend.url)
        try:  # what maxmemory-policy allkeys-lru does when capacity_bytes is 0
            client.delete(f"{tier.config.prefix}:c:{recs[0][0].key.hex()}")
        finally:
            client.close()
        assert tier.stats().chunks == 3, "the tier has not noticed yet"
        assert {i.key for i in tier.scan(FP)} == {recs[1][0].key, recs[2][0].key}
        s = tier.stats()
        assert (s.chunks, s.used_bytes) == (2, 2 * recs[0][0].record_size), (
            f"scan must prune the books of a vanished record: {s}"
        )
        assert len(list(tier.scan(FP))) == 2


def test_other_prefix_is_untouched(backend: Backend) -> None:
    with make_tier(backend.url) as mine, make_tier(backend.url) as yours:
        h, p, _ = record(seed=50)
        assert mine.put(h, p) is PutStatus.STORED and yours.put(h, p) is PutStatus.STORED
        assert mine.clear() == 1
        assert yours.get(h.key) is not None, "clear() must stay inside its own prefix"


# -- capacity ---------------------------------------------------------------------


def test_capacity_lru_eviction_pins_and_full(backend: Backend) -> None:
    recs = [record(seed=60 + i) for i in range(6)]
    size = recs[0][0].record_size
    evicted: list[ChunkKey] = []
    with make_tier(backend.url, capacity_bytes=3 * size) as tier:

        def on_evict(key: ChunkKey, header: RecordHeader, read: Callable[[], bytes | None]) -> None:
            blob = read()
            assert blob is not None and verify(blob, expect_key=key) == header, (
                "on_evict gets the whole record"
            )
            assert tier.contains([key]) == [True], "on_evict runs before the chunk is gone"
            evicted.append(key)

        tier.on_evict = on_evict
        a, b, c, d, e, f = (r[0] for r in recs)
        for h, p, _ in recs[:3]:
            assert tier.put(h, p) is PutStatus.STORED
        assert tier.get(a.key) is not None  # a is now the most recently used
        assert tier.put(d, recs[3][1]) is PutStatus.STORED
        assert evicted == [b.key], f"LRU victim should be b, got {evicted}"
        assert tier.contains([a.key, b.key, c.key, d.key]) == [True, False, True, True]
        assert tier.children(ROOT, FP).keys() == {a.key, c.key, d.key}, "evict updates children"
        assert tier.pin(c.key)
        assert tier.put(e, recs[4][1]) is PutStatus.STORED
        assert evicted[-1] == a.key, "c is pinned, so a (then least recent) goes"
        assert tier.pin(d.key) and tier.pin(e.key)
        assert tier.put(f, recs[5][1]) is PutStatus.FULL, "everything left is pinned"
        s = tier.stats()
        assert (s.evictions, s.chunks, s.used_bytes, s.rejected) == (2, 3, 3 * size, 1), s
        big = record(seed=70, n_tokens=64)
        assert tier.put(big[0], big[1]) is PutStatus.TOO_LARGE


def test_drifted_byte_counter_is_recounted_not_evicted_for(backend: Backend) -> None:
    recs = [record(seed=75 + i) for i in range(3)]
    size = recs[0][0].record_size
    with make_tier(backend.url, capacity_bytes=3 * size) as tier:
        for h, p, _ in recs[:2]:
            assert tier.put(h, p) is PutStatus.STORED
        client = raw_client(backend.url)
        try:
            client.set(f"{tier.config.prefix}:used", 100 * size)  # lost replies, crashed hosts
        finally:
            client.close()
        assert tier.put(recs[2][0], recs[2][1]) is PutStatus.STORED
        s = tier.stats()
        assert (s.evictions, s.chunks, s.used_bytes) == (0, 3, 3 * size), (
            f"a drifted counter must be recounted, not paid for with evictions: {s}"
        )
        assert tier.recount() == (3, 3 * size)


# -- corruption ----------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["payload", "header", "truncated"])
def test_corrupt_value_is_deleted_and_counted_miss(backend: Backend, damage: str) -> None:
    with make_tier(backend.url) as tier:
        reported: list[ChunkKey] = []
        tier.on_corrupt = reported.append
        h, p, _ = record(seed=80)
        assert tier.put(h, p) is PutStatus.STORED
        name = f"{tier.config.prefix}:c:{h.key.hex()}"
        client = raw_client(backend.url)
        try:
            if damage == "payload":
                client.setrange(name, h.header_size + 5, b"\xff\xfe")
            elif damage == "header":
                client.setrange(name, 20, b"garbage")
            else:
                client.set(name, client.getrange(name, 0, h.record_size - 10))
        finally:
            client.close()
        assert tier.get(h.key) is None, "a corrupt record must be a miss"
        assert reported == [h.key], "the store is told which record was dropped"
        s = tier.stats()
        assert (s.corrupt, s.misses, s.hits) == (1, 1, 0), s
        assert tier.contains([h.key]) == [False], "the corrupt record must be deleted"
        assert s.used_bytes == 0 and s.chunks == 0, f"bookkeeping cleaned: {s}"
        assert tier.put(h, p) is PutStatus.STORED, "the key can be written again"
        assert tier.get(h.key) is not None


# -- failures -----------------------------------------------------------------------


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_server_stopped_degrades_fast_then_recovers(solo: RedisServer) -> None:
    clock = FakeClock()
    tier = make_tier(solo.url, clock, failure_threshold=2, cooldown_ms=5000)
    try:
        h, p, _ = record(seed=90)
        h2, p2, _ = record(seed=91)
        assert tier.put(h, p) is PutStatus.STORED
        solo.stop()
        got, dt = _timed(lambda: tier.get(h.key))
        assert got is None and dt < 1.0, f"get must degrade to a miss quickly ({dt:.3f}s)"
        status, dt = _timed(lambda: tier.put(h2, p2))
        assert status is PutStatus.UNAVAILABLE and dt < 1.0, (status, dt)
        s = tier.stats()
        assert not s.healthy and s.detail["state"] == "open", s.detail
        assert s.errors >= 2 and "Error" in str(s.detail["last_error"]), s.detail
        # Open: nothing touches the network, every call answers at once.
        errors = s.errors
        for fn, want in (
            (lambda: tier.get(h.key), None),
            (lambda: tier.contains([h.key, h2.key]), [False, False]),
            (lambda: tier.children(h.key), {}),
            (lambda: tier.put(h2, p2), PutStatus.UNAVAILABLE),
        ):
            got, dt = _timed(fn)
            assert got == want and dt < 0.05, f"open breaker: got {got!r} in {dt:.3f}s"
        with pytest.raises(TierUnavailable, match="circuit breaker open"):
            tier.delete(h.key)
        assert tier.stats().errors == errors, "an open breaker makes no backend calls"
        assert int(str(tier.stats().detail["skipped"])) >= 5

        solo.start()  # same port; the data is gone (no persistence)
        assert tier.put(h2, p2) is PutStatus.UNAVAILABLE, "still cooling down"
        clock.advance(5)
        assert tier.put(h2, p2) is PutStatus.STORED, "after the cooldown the trial call works"
        assert tier.stats().healthy and tier.get(h2.key) is not None
    finally:
        tier.close()


def test_hung_server_respects_the_deadline(solo: RedisServer) -> None:
    tier = make_tier(solo.url, timeout_ms=100, retries=1, backoff_ms=10, failure_threshold=5)
    try:
        h, p, _ = record(seed=92)
        assert tier.put(h, p) is PutStatus.STORED
        solo.pause()
        try:
            got, dt = _timed(lambda: tier.get(h.key))
            # two attempts of 100 ms plus 10 ms backoff; generous slack for a busy machine
            assert got is None and dt < 0.9, f"get took {dt:.3f}s against a hung server"
            got, dt = _timed(lambda: tier.contains([h.key]))
            assert got == [False] and dt < 0.9, (got, dt)
            assert not tier.stats().healthy
        finally:
            solo.resume()
        assert tier.get(h.key) is not None, "the breaker stayed closed (5 failures allowed)"
        assert tier.stats().healthy
    finally:
        tier.close()


def test_server_out_of_memory_put_is_full(solo: RedisServer) -> None:
    with make_tier(solo.url) as tier:
        h, p, _ = record(seed=93, n_tokens=64, width=1024)  # 128 KiB
        used = int(solo.cli("info", "memory").split("used_memory:")[1].split()[0])
        solo.cli("config", "set", "maxmemory-policy", "noeviction")
        solo.cli("config", "set", "maxmemory", str(used + 1024))
        assert tier.put(h, p) in (PutStatus.STORED, PutStatus.FULL)
        h2, p2, _ = record(seed=94, n_tokens=64, width=1024)
        assert tier.put(h2, p2) is PutStatus.FULL, "OOM from the server is a full tier"
        assert tier.stats().healthy, "a full server is not a down server"


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_unreachable_at_start_does_not_raise(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}"
    tier, dt = _timed(lambda: make_tier(url))
    try:
        assert dt < 1.0, f"constructor took {dt:.3f}s"
        s = tier.stats()
        assert not s.healthy and s.detail["state"] == "open", s.detail
        h, p, _ = record(seed=95)
        assert tier.get(h.key) is None and tier.put(h, p) is PutStatus.UNAVAILABLE
    finally:
        tier.close()


def test_unreachable_cluster_at_start_does_not_raise() -> None:
    tier, dt = _timed(lambda: make_tier(f"valkey://127.0.0.1:{free_port()}?cluster=1"))
    try:
        assert dt < 1.0 and not tier.stats().healthy, dt
        assert tier.contains([record(seed=96)[0].key]) == [False]
    finally:
        tier.close()


def test_cluster_node_down_serves_the_rest_without_hanging() -> None:
    with ServerCluster(3, "valkey") as cluster:
        tier = make_tier(cluster.url, failure_threshold=1000)  # keep the breaker out of it
        try:
            recs = [record(seed=100 + i) for i in range(12)]
            for h, p, _ in recs:
                assert tier.put(h, p) is PutStatus.STORED
            names = {h.key: f"{tier.config.prefix}:c:{h.key.hex()}".encode() for h, _, _ in recs}
            owner = {k: cluster.node_of(n) for k, n in names.items()}
            dead = cluster.nodes[1]
            assert any(o is dead for o in owner.values()), "test needs keys on the dead node"
            cluster.stop_node(1)
            t0 = time.monotonic()
            for h, _, _ in recs:
                got = tier.get(h.key)
                if owner[h.key] is dead:
                    assert got is None, "a key on the dead node is a miss"
                else:
                    assert got is not None and verify(got, expect_key=h.key) == h, (
                        "keys on live nodes must still be served"
                    )
            present = tier.contains([h.key for h, _, _ in recs])
            assert present == [False] * len(recs) or present == [
                owner[h.key] is not dead for h, _, _ in recs
            ], present
            assert time.monotonic() - t0 < 5.0, "a dead node must not make calls hang"
            n_dead = sum(o is dead for o in owner.values())
            assert tier.stats().errors >= n_dead, "each failed call is counted"
        finally:
            tier.close()


# -- lifecycle and configuration ---------------------------------------------------------


def test_closed_tier_raises_but_stats_answers(backend: Backend) -> None:
    tier = make_tier(backend.url)
    tier.close()
    tier.close()  # idempotent
    h, p, _ = record(seed=110)
    for fn in (
        lambda: tier.get(h.key),
        lambda: tier.put(h, p),
        lambda: tier.contains([h.key]),
        lambda: tier.scan(),
        lambda: tier.clear(),
        lambda: tier.delete(h.key),
    ):
        with pytest.raises(StoreClosed):
            fn()
    s = tier.stats()
    assert not s.healthy and s.detail["closed"] is True


def test_parse_url_and_redact() -> None:
    assert parse_url("redis://h:1/0") == ("redis", False, "redis://h:1/0")
    assert parse_url("valkey://h:1?cluster=1") == ("valkey", True, "valkey://h:1")
    assert parse_url("rediss://h:1/2?cluster=true&ssl_cert_reqs=none") == (
        "redis",
        True,
        "rediss://h:1/2?ssl_cert_reqs=none",
    ), "only kvstore's params are removed"
    assert parse_url("unix:///tmp/r.sock?db=1")[0:2] == ("redis", False)
    assert parse_url("valkeys://h:1?cluster=0")[0:2] == ("valkey", False)
    with pytest.raises(ConfigError):
        parse_url("unix:///tmp/r.sock?cluster=1")
    with pytest.raises(ConfigError):
        parse_url("redis://h:1?cluster=maybe")
    assert redact("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis://h:1") == "redis://h:1"
    with pytest.raises(ConfigError):
        RemoteTier(RemoteConfig(url=""))
