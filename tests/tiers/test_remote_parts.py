"""Big records in L3: stored in parts behind a manifest, read straight into the caller's
buffer, found whole or not at all (kvstore.engine.tiers.remote_parts), over kvstore's own RESP
client (kvstore.engine.tiers.remote_resp, remote_values), against real servers: Redis and Valkey,
standalone and cluster."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import RemoteConfig
from kvstore.engine.tiers.remote import RemoteTier
from kvstore.engine.tiers.remote_parts import MANIFEST_TAG, PART_BYTES, part_names
from kvstore.engine.tiers.remote_resp import RespConnectionError, RespError, RespPool
from kvstore.keys import ROOT, chunk_key, tokens_to_bytes
from kvstore.records import Codec, RecordHeader, make_header
from kvstore.testing.redis import RedisServer, ServerCluster
from kvstore.types import PutStatus
from tests.tiers.test_remote import FP, Backend, make_tier, raw_client
from tests.tiers.test_remote import pytestmark as pytestmark  # needs both servers

BIG = 4 * PART_BYTES + 12_345  # five parts, the last one short
KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module", params=["redis", "valkey", "redis-cluster", "valkey-cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    kind = request.param
    if kind.endswith("-cluster"):
        with ServerCluster(3, kind.split("-")[0]) as cluster:
            yield Backend(kind, cluster.url, cluster=cluster)
    else:
        with RedisServer(kind) as server:
            yield Backend(kind, server.url, server=server)


def big_record(seed: int, nbytes: int = BIG) -> tuple[RecordHeader, np.ndarray]:
    """A raw uint8 first chunk of random (incompressible) bytes."""
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, nbytes, dtype=np.uint8)
    tokens = tokens_to_bytes(rng.integers(0, 50_000, 16))
    header = make_header(
        key=chunk_key(ROOT, FP, tokens),
        parent=ROOT,
        fingerprint=FP,
        token_bytes=tokens,
        dtype="uint8",
        shape=(nbytes,),
        payload=payload.data,
    )
    return header, payload


def names(tier: RemoteTier, header: RecordHeader) -> list[str]:
    return part_names(tier.config.prefix, header.key, -(-header.stored_size // PART_BYTES))


def test_big_record_round_trip_in_parts(backend: Backend) -> None:
    tier = make_tier(backend.url, timeout_ms=5000)
    raw = raw_client(backend.url)
    try:
        h, payload = big_record(1)
        assert tier.put(h, payload.data) is PutStatus.STORED
        assert tier.put(h, payload.data) is PutStatus.EXISTS, "a second put must not rewrite it"
        manifest = raw.get(tier._c(h.key))
        assert len(manifest) < 4096 and MANIFEST_TAG in manifest, "the record is not in parts"
        sizes = [raw.strlen(n) for n in names(tier, h)]
        assert sizes == [PART_BYTES] * 4 + [12_345], sizes
        out = np.zeros(BIG + 100, np.uint8)
        got = tier.get_into(h.key, memoryview(out))
        assert got is not None and got.key == h.key
        assert np.array_equal(out[:BIG], payload), "get_into delivered other bytes"
        blob = tier.get(h.key)
        assert blob is not None and blob[h.header_size :] == payload.tobytes()
        assert tier.contains([h.key]) == [True]
        assert [c.key for c in tier.scan(FP)] == [h.key]
        s = tier.stats()
        assert s.hits == 2 and s.detail["torn"] == 0 and s.detail["fast_path"], s.detail
    finally:
        tier.close()
        raw.close()


@pytest.mark.parametrize("codec", ["zstd", "zstd_shuffle"])
def test_big_compressed_record_decodes_into_the_buffer(backend: Backend, codec: str) -> None:
    tier = make_tier(backend.url, timeout_ms=5000, codec=codec)
    try:
        h, payload = big_record(2)
        assert tier.put(h, payload.data) is PutStatus.STORED
        out = np.zeros(BIG, np.uint8)
        got = tier.get_into(h.key, memoryview(out))
        assert got is not None and got.codec == Codec.parse(codec)
        assert np.array_equal(out, payload)
    finally:
        tier.close()


@pytest.mark.parametrize("damage", ["missing", "short", "flipped"])
def test_torn_or_damaged_part_is_a_deleted_counted_miss(backend: Backend, damage: str) -> None:
    tier = make_tier(backend.url, timeout_ms=5000)
    raw = raw_client(backend.url)
    try:
        h, payload = big_record(3)
        assert tier.put(h, payload.data) is PutStatus.STORED
        parts = names(tier, h)
        if damage == "missing":  # what a server's maxmemory eviction does to one part
            raw.delete(parts[2])
        elif damage == "short":
            raw.set(parts[2], b"x" * 100)
        else:
            part = bytearray(raw.get(parts[2]))
            part[1000] ^= 0xFF
            raw.set(parts[2], bytes(part))
        out = np.zeros(BIG, np.uint8)
        assert tier.get_into(h.key, memoryview(out)) is None, f"a {damage} part was served"
        s = tier.stats()
        assert s.misses == 1
        if damage == "flipped":
            assert s.corrupt == 1 and s.detail["torn"] == 0, s.detail
        else:
            assert s.detail["torn"] == 1 and s.corrupt == 0, s.detail
        assert raw.exists(tier._c(h.key)) == 0, "the broken record was left behind"
        assert sum(raw.exists(n) for n in parts) == 0, "parts of the broken record were left"
        assert tier.put(h, payload.data) is PutStatus.STORED, "the chunk cannot be stored again"
        assert tier.get_into(h.key, memoryview(out)) is not None
        assert np.array_equal(out, payload)
    finally:
        tier.close()
        raw.close()


def other_bytes(h: RecordHeader, seed: int) -> tuple[RecordHeader, np.ndarray]:
    """The same chunk (key, tokens) with other bytes: what another host's GPU computes."""
    payload = np.random.default_rng(seed).integers(0, 256, h.raw_size, dtype=np.uint8)
    header = make_header(
        key=h.key,
        parent=h.parent,
        fingerprint=h.fingerprint,
        token_bytes=h.token_bytes,
        dtype="uint8",
        shape=(h.raw_size,),
        payload=payload.data,
    )
    return header, payload


def test_a_second_writer_never_tears_a_stored_record(backend: Backend) -> None:
    """Two hosts store the same chunk with different bytes (kernels are not
    bit-reproducible). Part names follow from the key alone; the second writer used to
    rewrite the first one's parts before its SET NX failed, leaving an acknowledged
    record that no longer verified (a counted, deleted miss on the next read)."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    first = make_tier(backend.url, timeout_ms=5000, prefix=prefix)
    second = make_tier(backend.url, timeout_ms=5000, prefix=prefix)
    try:
        h, payload = big_record(11)
        assert first.put(h, payload.data) is PutStatus.STORED
        h2, other = other_bytes(h, 12)
        assert second.put(h2, other.data) is PutStatus.EXISTS
        for reader in (first, second):
            out = np.zeros(BIG, np.uint8)
            assert reader.get_into(h.key, memoryview(out)) is not None, (
                f"the stored record was torn by the second writer: {reader.stats().detail}"
            )
            assert np.array_equal(out, payload), "the record read is not the one stored first"
        assert first.stats().detail["torn"] == second.stats().detail["torn"] == 0
    finally:
        first.close()
        second.close()


def test_a_writer_finding_a_live_claim_leaves_the_parts_alone(backend: Backend) -> None:
    """While one writer is writing a record's parts (its claim is live), another writer
    of the same chunk answers EXISTS without writing; once the claim is gone (ended or
    lapsed) the chunk can be stored."""
    tier = make_tier(backend.url, timeout_ms=5000)
    raw = raw_client(backend.url)
    try:
        h, payload = big_record(13)
        claim = tier._claim_name(h.key)
        raw.set(claim, b"someone-else", px=60_000)
        assert tier.put(h, payload.data) is PutStatus.EXISTS
        assert sum(raw.exists(n) for n in names(tier, h)) == 0, "parts written under a claim"
        assert raw.get(claim) == b"someone-else", "another writer's claim was ended"
        raw.delete(claim)
        assert tier.put(h, payload.data) is PutStatus.STORED
        assert raw.exists(claim) == 0, "the writer's own claim outlived its put"
        out = np.zeros(BIG, np.uint8)
        assert tier.get_into(h.key, memoryview(out)) is not None
        assert np.array_equal(out, payload)
    finally:
        tier.close()
        raw.close()


def test_delete_and_clear_remove_the_parts(backend: Backend) -> None:
    tier = make_tier(backend.url, timeout_ms=5000)
    raw = raw_client(backend.url)
    try:
        h1, p1 = big_record(4)
        h2, p2 = big_record(5)
        assert tier.put(h1, p1.data) is PutStatus.STORED
        assert tier.put(h2, p2.data) is PutStatus.STORED
        assert tier.delete(h1.key)
        assert sum(raw.exists(n) for n in names(tier, h1)) == 0, "delete left parts behind"
        assert sum(raw.exists(n) for n in names(tier, h2)) == 5
        assert tier.clear() == 1
        assert sum(raw.exists(n) for n in names(tier, h2)) == 0, "clear left parts behind"
    finally:
        tier.close()
        raw.close()


def test_sealed_big_record_and_a_forged_one(backend: Backend, tmp_path: Path) -> None:
    key_file = tmp_path / "remote.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    keyed = make_tier(backend.url, timeout_ms=5000, prefix=prefix, auth_key_file=str(key_file))
    plain = make_tier(backend.url, timeout_ms=5000, prefix=prefix)
    try:
        h, payload = big_record(6)
        assert keyed.put(h, payload.data) is PutStatus.STORED
        out = np.zeros(BIG, np.uint8)
        assert keyed.get_into(h.key, memoryview(out)) is not None and np.array_equal(out, payload)
        out[:] = 0
        assert plain.get_into(h.key, memoryview(out)) is not None, "a plain reader refused it"
        assert np.array_equal(out, payload)
        forged, fp = big_record(7)
        assert plain.put(forged, fp.data) is PutStatus.STORED  # no MAC
        assert keyed.get_into(forged.key, memoryview(out)) is None, "a forged record was served"
        assert keyed.stats().detail["forged"] == 1
    finally:
        keyed.close()
        plain.close()


def test_a_hung_server_keeps_the_deadline_on_a_big_read() -> None:
    with RedisServer("valkey") as server:
        tier = make_tier(server.url, timeout_ms=300, retries=0, failure_threshold=5)
        try:
            h, payload = big_record(8)
            assert tier.put(h, payload.data) is PutStatus.STORED
            server.pause()
            try:
                out = np.zeros(BIG, np.uint8)
                t0 = time.monotonic()
                got = tier.get_into(h.key, memoryview(out))
                dt = time.monotonic() - t0
                assert got is None and dt < 1.0, f"get_into took {dt:.2f}s against a hung server"
            finally:
                server.resume()
            assert tier.get_into(h.key, memoryview(out)) is not None
            assert np.array_equal(out, payload)
        finally:
            tier.close()


def test_a_hung_server_keeps_the_deadline_on_a_big_write() -> None:
    """A server that stops reading: the parts fill the socket buffers, the send times out
    within the call's deadline, the put is UNAVAILABLE, and the next put after the server
    resumes goes through (the half-sent connection was dropped, not reused)."""
    with RedisServer("redis") as server:
        tier = make_tier(server.url, timeout_ms=300, retries=0, failure_threshold=5)
        try:
            h, payload = big_record(10, 16 * PART_BYTES)  # 32 MiB: more than socket buffers
            server.pause()
            try:
                t0 = time.monotonic()
                status = tier.put(h, payload.data)
                dt = time.monotonic() - t0
            finally:
                server.resume()
            assert status is PutStatus.UNAVAILABLE, status
            assert dt < 1.0, f"put took {dt:.2f}s against a hung server (deadline 0.3 s)"
            h2, payload2 = big_record(11)
            assert tier.put(h2, payload2.data) is PutStatus.STORED
            out = np.zeros(BIG, np.uint8)
            assert tier.get_into(h2.key, memoryview(out)) is not None
            assert np.array_equal(out, payload2)
        finally:
            tier.close()


def test_cluster_client_follows_moved(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale slot map (as after a failover or resharding) sends a call to the wrong node:
    its MOVED reply is followed, and the topology is re-read before the next call."""
    if backend.cluster is None:
        pytest.skip("cluster only")
    tier = make_tier(backend.url, timeout_ms=5000)
    try:
        h, payload = big_record(9)
        assert tier.put(h, payload.data) is PutStatus.STORED
        client = tier._connect()
        owner = backend.cluster.node_of(tier._c(h.key).encode())
        wrong = next(n for n in client.get_primaries() if int(n.port) != owner.port)
        real = client.nodes_manager.get_node_from_slot
        stale = {"left": 1}

        def lying(slot: int, *args: Any, **kwargs: Any) -> Any:
            if stale["left"]:  # the fault: one lookup answers with another node
                stale["left"] -= 1
                return wrong
            return real(slot, *args, **kwargs)

        monkeypatch.setattr(client.nodes_manager, "get_node_from_slot", lying)
        out = np.zeros(BIG, np.uint8)
        assert tier.get_into(h.key, memoryview(out)) is not None
        assert np.array_equal(out, payload)
        d = tier.stats().detail
        assert d["redirects"] >= 1, d
    finally:
        tier.close()


def test_resp_client_error_reply_keeps_the_connection_and_down_is_down() -> None:
    with RedisServer("redis") as server:
        pool = RespPool("127.0.0.1", server.port, connect_timeout_s=1.0)
        try:
            assert pool.run(lambda c: c.call(("SET", "k", (b"ab", b"cd")), 1.0)) == b"OK"
            pool.run(lambda c: c.call(("HSET", "h", "f", "v"), 1.0))
            with pytest.raises(RespError) as e:
                pool.run(lambda c: c.call(("GET", "h"), 1.0))
            assert e.value.word == "WRONGTYPE"
            assert pool.run(lambda c: c.call(("GET", "k"), 1.0)) == b"abcd"
            assert len(pool._idle) == 1, "an error reply must not cost the connection"
        finally:
            pool.close()
        server.stop()
        with pytest.raises(RespConnectionError):
            RespPool("127.0.0.1", server.port, connect_timeout_s=0.5).run(
                lambda c: c.call(("PING",), 0.5)
            )


def test_sentinel_url_is_validated() -> None:
    ok = RemoteConfig(url="redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26379/mymaster/1")
    assert ok.url.startswith("redis+sentinel://")
    for bad in (
        "redis+sentinel://10.0.0.1/mymaster",  # no port
        "valkey+sentinel://10.0.0.1:26379",  # no service
        "redis+sentinel://10.0.0.1:26379/svc/x",  # db not a number
    ):
        with pytest.raises(ValueError, match="sentinel URL"):
            RemoteConfig(url=bad)
