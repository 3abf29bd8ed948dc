"""RemoteTier against a Redis/Valkey that refuses writes, and with records authenticated by a
key (``remote.auth_key_file``), on real redis-server and valkey-server processes.

Refusals are error replies from a server that is up: ``min-replicas-to-write`` unmet
(``NOREPLICAS``), a key under the tier's prefix holding a value of another type
(``WRONGTYPE``) or a non-number. Forged records are self-consistent records packed with
kvstore's own ``records.encode`` and planted with a plain client, without the key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import FakeClock
from kvstore.config import RemoteConfig
from kvstore.engine.tiers.remote import RemoteTier
from kvstore.engine.tiers.remote_guard import TRAILER_BYTES, TRAILER_TAG
from kvstore.errors import ConfigError
from kvstore.records import encode, verify
from kvstore.testing.redis import RedisServer, ServerCluster
from kvstore.types import PutStatus
from tests.tiers.test_remote import BACKENDS, FP, Backend, config, make_tier, raw_client, record
from tests.tiers.test_remote import pytestmark as pytestmark  # needs both servers

KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "valkey-cluster":
        with ServerCluster(3, "valkey") as cluster:
            yield Backend(request.param, cluster.url, cluster=cluster)
    else:
        with RedisServer(request.param) as server:
            yield Backend(request.param, server.url, server=server)


@pytest.fixture(params=["redis", "valkey"])
def solo(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server of its own: these tests reconfigure it."""
    with RedisServer(request.param) as server:
        yield server


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "remote.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvstore.engine.tiers.remote" and r.levelno == logging.WARNING
    ]


# -- refusals -----------------------------------------------------------------------


def test_noreplicas_degrades_holds_writes_back_and_recovers(
    solo: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    caplog.set_level(logging.WARNING, "kvstore.engine.tiers.remote")
    with make_tier(solo.url, clock, failure_threshold=2, cooldown_ms=1000) as tier:
        h0, p0, _ = record(seed=300)
        assert tier.put(h0, p0) is PutStatus.STORED
        solo.cli("CONFIG", "SET", "min-replicas-to-write", "1")
        try:
            puts = [record(seed=301 + i)[:2] for i in range(6)]
            got = [tier.put(h, p) for h, p in puts[:2]]
            assert got == [PutStatus.UNAVAILABLE] * 2, "a refused write is not stored"
            s = tier.stats()
            assert not s.healthy, f"a tier that refuses writes must not say healthy: {s.detail}"
            assert s.detail["degraded"] is True and s.detail["refused"] == 2, s.detail
            assert "NOREPLICAS" in str(s.detail["last_refusal"]), s.detail
            assert s.detail["writes"] == "open", "two refusals in a row hold writes back"
            assert s.detail["state"] == "closed", "refusals are not an outage: reads go on"
            assert tier.get(h0.key) is not None, "reads must still be served"
            errors = s.errors
            for h, p in puts[2:]:
                assert tier.put(h, p) is PutStatus.UNAVAILABLE
            s = tier.stats()
            assert s.errors == errors and s.detail["refused"] == 2, (
                f"puts held back must not reach the server: {s.detail}"
            )
            assert s.detail["writes_skipped"] == 4, s.detail
            assert not tier.accepting, "the store must not send its backlog now"
            warned = _warnings(caplog)
            assert len(warned) == 1 and "min-replicas-to-write" in warned[0], warned
            clock.advance(1.0)
            assert tier.accepting, "after the cooldown one trial write goes out"
            assert tier.put(*puts[2]) is PutStatus.UNAVAILABLE
            assert tier.stats().detail["refused"] == 3 and not tier.accepting
            assert len(_warnings(caplog)) == 1, "refusals are logged at most every 30 s"
        finally:
            solo.cli("CONFIG", "SET", "min-replicas-to-write", "0")
        assert tier.put(*puts[3]) is PutStatus.UNAVAILABLE, "still holding writes back"
        clock.advance(1.0)
        assert tier.put(*puts[3]) is PutStatus.STORED, "the trial write after the fix lands"
        s = tier.stats()
        assert s.healthy and s.detail["degraded"] is False and s.detail["writes"] == "closed"
        assert tier.put(*puts[4]) is PutStatus.STORED


@pytest.mark.parametrize("name", ["sz", "used", "n"])
def test_foreign_value_under_a_bookkeeping_key_is_a_refusal(
    solo: RedisServer, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvstore.engine.tiers.remote")
    capacity = 1 << 20 if name == "used" else 0
    with make_tier(solo.url, failure_threshold=3, capacity_bytes=capacity) as tier:
        p = tier.config.prefix
        foreign = {"sz": f"{p}:sz", "used": f"{p}:used", "n": f"{p}:n:{FP.hex()}"}[name]
        client = raw_client(solo.url)
        try:
            client.set(foreign, b"not kvstore's")
            h, pl, _ = record(seed=310)
            assert tier.put(h, pl) is PutStatus.UNAVAILABLE
            s = tier.stats()
            assert s.detail["refused"] >= 1 and s.detail["degraded"] is True, s.detail
            assert not s.healthy
            assert client.exists(f"{p}:c:{h.key.hex()}") == 0, "no record left unbooked"
            assert any(
                foreign in w or "not kvstore" in w or "WRONGTYPE" in w for w in _warnings(caplog)
            ), _warnings(caplog)
            client.delete(foreign)
        finally:
            client.close()
        assert tier.put(h, pl) is PutStatus.STORED, "once the key is gone, writes land"
        assert tier.stats().healthy and tier.get(h.key) is not None


@pytest.mark.parametrize("how", ["read-only replica", "ACL without SET"])
def test_replica_and_acl_refusals_degrade_with_a_hint(
    solo: RedisServer, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvstore.engine.tiers.remote")
    with RedisServer(solo.flavor) as other:
        if how == "read-only replica":
            other.cli("REPLICAOF", "127.0.0.1", str(solo.port))
            url, hint = other.url, "read-only replica"
        else:
            solo.cli("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-set")
            url, hint = f"{solo.flavor}://kv:pw@127.0.0.1:{solo.port}", "ACL user may not"
        with make_tier(url) as tier:
            assert tier.put(*record(seed=315)[:2]) is PutStatus.UNAVAILABLE
            s = tier.stats()
            assert not s.healthy and s.detail["writes_refused"] == 1, s.detail
        assert any(hint in w for w in _warnings(caplog)), _warnings(caplog)
        assert all(":pw@" not in w for w in _warnings(caplog)), "passwords stay hidden"


def test_foreign_value_under_a_record_key_is_corrupt_and_replaced(backend: Backend) -> None:
    with make_tier(backend.url) as tier:
        reported: list[bytes] = []
        tier.on_corrupt = reported.append
        h, p, _ = record(seed=320)
        name = f"{tier.config.prefix}:c:{h.key.hex()}"
        client = raw_client(backend.url)
        try:
            client.hset(name, "x", "y")
            assert tier.get(h.key) is None, "a hash is no record"
            assert client.exists(name) == 0, "it must be deleted, else SET NX never replaces it"
        finally:
            client.close()
        s = tier.stats()
        assert (s.corrupt, reported) == (1, [h.key]), (s, reported)
        assert tier.put(h, p) is PutStatus.STORED and tier.get(h.key) is not None


# -- record authentication ----------------------------------------------------------


def _plant(url: str, prefix: str, blob: bytes, key: bytes) -> None:
    client = raw_client(url)
    try:
        client.set(f"{prefix}:c:{key.hex()}", blob)
    finally:
        client.close()


def _forge(seed: int) -> tuple[Any, bytes]:
    """A self-consistent record, packed with kvstore's own code but without the key."""
    h, _, raw = record(seed=seed)
    blob = encode(
        key=h.key,
        parent=h.parent,
        fingerprint=h.fingerprint,
        token_bytes=h.token_bytes,
        dtype=h.dtype,
        shape=h.shape,
        payload=bytes(b ^ 0x5A for b in raw),  # poisoned KV, checksums all correct
    )
    return verify(blob), blob


@pytest.fixture
def keyed(backend: Backend, key_file: Path) -> Iterator[tuple[RemoteTier, RemoteTier]]:
    """(a tier with the key, a tier without it) on the same prefix."""
    cfg = config(backend.url, codec="zstd_shuffle", auth_key_file=str(key_file))
    plain = RemoteConfig(**{**vars(cfg), "auth_key_file": ""})
    with RemoteTier(cfg, clock=FakeClock()) as a, RemoteTier(plain, clock=FakeClock()) as b:
        yield a, b


def test_sealed_records_round_trip_and_plain_servers_still_read_them(
    backend: Backend, keyed: tuple[RemoteTier, RemoteTier]
) -> None:
    a, b = keyed
    h, p, _ = record(seed=330)
    assert a.put(h, p) is PutStatus.STORED
    client = raw_client(backend.url)
    try:
        value = client.get(f"{a.config.prefix}:c:{h.key.hex()}")
    finally:
        client.close()
    got = a.get(h.key)
    assert got is not None and len(value) == len(got) + TRAILER_BYTES, "one 40-byte trailer"
    assert value[len(got) : len(got) + len(TRAILER_TAG)] == TRAILER_TAG
    assert verify(got).key == h.key, "get returns the record without its trailer"
    assert b.get(h.key) == got, "a server without the key serves the record (checksums only)"
    s = a.stats()
    assert s.used_bytes == len(value) and s.detail["authenticated"] is True
    assert KEY.decode() not in repr(s) and KEY.decode() not in repr(a.config.auth_key_file)


def test_forged_record_is_refused_with_the_key_and_served_without(
    backend: Backend, keyed: tuple[RemoteTier, RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvstore.engine.tiers.remote")
    a, b = keyed
    reported: list[bytes] = []
    a.on_corrupt = reported.append
    h, blob = _forge(340)
    _plant(backend.url, a.config.prefix, blob, h.key)
    assert b.get(h.key) == blob, "without the key a self-consistent record is served (the limit)"
    assert a.get(h.key) is None, "with the key a record without a MAC is a miss"
    s = a.stats()
    assert (s.corrupt, s.detail["forged"], reported) == (1, 1, [h.key]), s
    assert a.contains([h.key]) == [False], "the forged record is deleted"
    assert any("refused" in w and h.key.hex()[:16] in w for w in _warnings(caplog))
    assert all(KEY.decode() not in w for w in _warnings(caplog)), "the key is never logged"


@pytest.mark.parametrize("how", ["payload swapped", "trailer of another record", "mac flipped"])
def test_tampered_sealed_record_is_refused(
    backend: Backend, keyed: tuple[RemoteTier, RemoteTier], how: str
) -> None:
    """The MAC covers the payload, not just the header that holds its (xxh3) checksum."""
    a, _ = keyed
    h, p, _ = record(seed=350)
    h2, p2, _ = record(seed=351)
    assert a.put(h, p) is PutStatus.STORED and a.put(h2, p2) is PutStatus.STORED
    client = raw_client(backend.url)
    name = f"{a.config.prefix}:c:{h.key.hex()}"
    try:
        value = client.get(name)
        trailer = value[-TRAILER_BYTES:]
        forged, fblob = _forge(350)  # same key, other payload
        if how == "payload swapped":
            new = fblob + trailer
        elif how == "trailer of another record":
            new = fblob + client.get(f"{a.config.prefix}:c:{h2.key.hex()}")[-TRAILER_BYTES:]
        else:
            new = value[:-1] + bytes([value[-1] ^ 1])
        client.set(name, new)
    finally:
        client.close()
    assert forged.key == h.key
    assert a.get(h.key) is None, f"{how}: must be refused"
    assert a.stats().detail["forged"] == 1


def test_forged_record_is_not_handed_down_on_eviction(solo: RedisServer, key_file: Path) -> None:
    with make_tier(
        solo.url, capacity_bytes=12 * 1024, auth_key_file=str(key_file), codec="raw"
    ) as tier:
        moved: list[bytes] = []
        tier.on_evict = lambda k, _h, _b: moved.append(k)
        h, blob = _forge(360)
        assert tier.put(*record(seed=361)[:2]) is PutStatus.STORED
        _plant(solo.url, tier.config.prefix, blob, h.key)
        client = raw_client(solo.url)
        p = tier.config.prefix
        client.hset(f"{p}:sz", h.key, len(blob))
        client.incrby(f"{p}:used", len(blob))
        client.zadd(f"{p}:lru", {h.key: 0.5})  # the oldest: evicted first
        client.close()
        for i in range(12):
            assert tier.put(*record(seed=362 + i)[:2]).ok
        assert moved, "the test needs evictions"
        assert h.key not in moved, "a forged record must never move to another tier"
        assert tier.contains([h.key]) == [False], "it was evicted (and dropped)"
        assert tier.stats().detail["forged"] == 1


# -- the key file -------------------------------------------------------------------


def test_key_file_is_checked_at_construction(tmp_path: Path) -> None:
    def fails(path: Path, match: str) -> None:
        with pytest.raises(ConfigError, match=match) as e:
            RemoteConfig(url="redis://h:1", auth_key_file=str(path))
        assert KEY.decode() not in str(e.value), "the key never appears in a message"

    fails(tmp_path / "missing", "cannot read it")
    fails(tmp_path, "not a regular file")
    short = tmp_path / "short"
    short.write_bytes(b"  tooshort \n")
    short.chmod(0o600)
    fails(short, "16-4096 bytes .* holds 8")
    shared = tmp_path / "shared"
    shared.write_bytes(KEY)
    shared.chmod(0o620)
    fails(shared, "writable by group or others .*0620.*chmod 600")
    os.mkfifo(tmp_path / "fifo")
    fails(tmp_path / "fifo", "not a regular file")
    good = tmp_path / "good"
    good.write_bytes(b"\n" + KEY + b"\n")
    good.chmod(0o400)
    cfg = RemoteConfig(url="redis://h:1", auth_key_file=str(good))
    assert cfg.auth_key() == KEY and KEY.decode() not in repr(cfg)
