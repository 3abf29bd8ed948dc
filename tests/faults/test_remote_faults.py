"""The remote tier (L3) goes away under load and comes back, refuses writes, or holds
records that nobody with the deployment's key wrote.

Builds on tests/tiers/test_remote.py (the tier alone: breaker, deadlines, a dead
cluster node) and tests/test_store_remote.py (the store keeps serving L1/L2): here
a real kvstore-server serves 8 clients while Redis is stopped and started again,
or a Valkey cluster node goes away. Every call must still be answered in time
(no client error, no slow call), the tier must show as unhealthy in Stats and in
the Prometheus metrics, and once it is back, new chunks must reach it again.

A Redis that answers but refuses writes (``min-replicas-to-write`` unmet, a foreign
value under a bookkeeping key) must show the same way, be logged, cost a bounded
number of tries, and get the chunks it refused once it takes writes again. A record
planted in Redis without the key (``remote.auth_key_file``) must not be served by a
server that has it.
"""

from __future__ import annotations

import time
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.keys import ROOT, Namespace
from kvstore.testing.mix import Mix, MixConfig, Tally, payload_for, wait_for
from kvstore.testing.redis import RedisServer, ServerCluster, available, free_port
from kvstore.testing.server import KVServer

LOAD_S = 8.0
SLOWEST_OK_S = 2.5  # remote timeout_ms=200 with one retry: no call should come near this


def _server(
    make_server: Callable[..., KVServer],
    tmp_path: Path,
    url: str,
    *,
    name: str = "remote",
    remote: str = "",
    args: Sequence[str] = ("--log-level", "error"),
) -> tuple[KVServer, int]:
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[remote]\nurl = "{url}"\ntimeout_ms = 200\nconnect_timeout_ms = 200\n'
        f"retries = 1\nfailure_threshold = 2\ncooldown_ms = 500\n{remote}"
    )
    port = free_port()
    srv = make_server(
        name,
        args=[
            "--config",
            str(config),
            "--chunk-tokens",
            "16",
            "--granularity",
            "4",
            "--metrics-port",
            str(port),
            *args,
        ],
    ).start()
    return srv, port


def _remote(c: kvstore.Client) -> Any:
    return next(t for t in c.stats().tiers if t.name == "remote")


def _metric(port: int, prefix: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {prefix} at /metrics")


def _metric_healthy(port: int) -> float:
    return _metric(port, 'kvstore_tier_healthy{tier="remote"}')


def _reaches_remote(c: kvstore.Client, tag: str) -> bool:
    """A new chunk is written through to the remote tier (tier 3) within a few seconds."""
    ns = Namespace(model="faults-remote", dtype="bfloat16", layout=tag)
    toks = [int(time.monotonic_ns() % 1_000_000) + i for i in range(16)]
    key = kvstore.keys.chunk_key(ROOT, ns.fingerprint, kvstore.keys.tokens_to_bytes(toks))
    _, status = c.put_chunk(ns, ROOT, toks, payload_for(key, 16 * 64), "bfloat16", (16, 32))
    assert status.ok, status
    try:
        wait_for(lambda: 3 in c.exists([key])[0], 5.0, "a new chunk to reach the remote")
    except AssertionError:
        return False
    return True


def _outage(
    srv: KVServer, port: int, down: Callable[[], object], up: Callable[[], object], tag: str
) -> tuple[Tally, dict[str, Any]]:
    mix = Mix(
        MixConfig(
            url=[srv.unix_url, srv.tcp_url],
            clients=8,
            seconds=LOAD_S,
            shm=lambda i: i % 2 == 0,
            timeout=5.0,
            seed=3,
            tag=tag,
        )
    )
    out: dict[str, Any] = {}
    with kvstore.Client(srv.unix_url, shm=False) as c:
        assert _remote(c).healthy, "the remote must be healthy before the fault"
        assert _reaches_remote(c, f"{tag}-before"), "chunks must reach the remote before"
        mix.start()
        time.sleep(2.0)
        errors_before = _remote(c).errors
        down()
        t_down = time.monotonic()
        out["detect_s"] = wait_for(
            lambda: not _remote(c).healthy, 10.0, "Stats to report the remote tier unhealthy"
        )
        out["metric_down"] = _metric_healthy(port)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t_down)))  # serve a while without it
        up()
        t_up = time.monotonic()
        out["recovery_s"] = wait_for(
            lambda: _remote(c).healthy, 15.0, "the remote tier to be healthy again"
        )
        out["recovery_s"] = time.monotonic() - t_up
        out["metric_up"] = _metric_healthy(port)
        out["errors"] = _remote(c).errors - errors_before
        out["used_again"] = _reaches_remote(c, f"{tag}-after")
        tally = mix.join(LOAD_S + 60)
        out["alive"] = c.health()
    return tally, out


def _check(srv: KVServer, tally: Tally, out: dict[str, Any]) -> None:
    assert out["alive"], srv.log()
    assert tally.errors == 0 and tally.lost == 0 and tally.wrong == 0, (
        f"{tally.summary()}\n" + "\n".join(tally.details)
    )
    assert tally.slowest < SLOWEST_OK_S, f"a call took {tally.slowest:.2f} s without the remote"
    assert out["metric_down"] == 0.0 and out["metric_up"] == 1.0, out
    assert out["errors"] > 0, f"the remote's failures must be counted: {out}"
    assert out["used_again"], "new chunks must reach the remote once it is back"
    assert tally.hits > 50, f"too little load: {tally.summary()}"


@pytest.mark.skipif(not available("redis"), reason="redis-server is not installed")
def test_redis_stopped_and_started_under_load(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    with RedisServer("redis") as redis:
        srv, port = _server(make_server, tmp_path, redis.url)
        tally, out = _outage(srv, port, redis.stop, redis.start, "redis")
        record(
            "Remote tier",
            "Redis stopped and started under load",
            f"8 clients x {LOAD_S:.0f} s of put/get/lookup/delete; Redis stopped for ~3 s "
            "mid-load, then started again (empty)",
            faults=1,
            requests=tally.requests,
            lost=tally.lost,
            wrong=tally.wrong,
            recovery_s=out["recovery_s"],
            notes=f"unhealthy in Stats after {out['detect_s']:.2f} s; slowest call "
            f"{tally.slowest:.2f} s; {out['errors']} remote errors counted; "
            f"recovery = Redis up to tier healthy",
        )
        _check(srv, tally, out)
        assert srv.stop() == 0, srv.log()


@pytest.mark.skipif(not available("valkey"), reason="valkey-server is not installed")
def test_valkey_cluster_node_down_under_load(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    with ServerCluster(3, "valkey") as cluster:
        srv, port = _server(make_server, tmp_path, cluster.url)

        def up() -> None:
            cluster.start_node(1)
            cluster.wait_ok()

        tally, out = _outage(srv, port, lambda: cluster.stop_node(1), up, "cluster")
        record(
            "Remote tier",
            "Valkey cluster node down under load",
            f"8 clients x {LOAD_S:.0f} s; one of 3 Valkey cluster primaries stopped for "
            "~3 s mid-load, then started again",
            faults=1,
            requests=tally.requests,
            lost=tally.lost,
            wrong=tally.wrong,
            recovery_s=out["recovery_s"],
            notes=f"unhealthy in Stats after {out['detect_s']:.2f} s; slowest call "
            f"{tally.slowest:.2f} s; {out['errors']} remote errors counted",
        )
        _check(srv, tally, out)
        assert srv.stop() == 0, srv.log()


# -- a Redis that answers, and refuses writes --------------------------------------------

REFUSING_S = 3.0  # how long the server runs against the refusing Redis before the fix
CHUNKS = 40


def _chunks(c: kvstore.Client, tag: str, n: int) -> dict[bytes, bytes]:
    """n chunks of one prompt, put through ``c``; key -> payload."""
    ns = Namespace(model="faults-remote", dtype="bfloat16", layout=tag)
    out: dict[bytes, bytes] = {}
    parent = ROOT
    for i in range(n):
        toks = [zlib.crc32(tag.encode()) % 1000 * 1000 + 16 * i + j for j in range(16)]
        key = kvstore.keys.chunk_key(parent, ns.fingerprint, kvstore.keys.tokens_to_bytes(toks))
        payload = payload_for(key, 16 * 64)
        _, status = c.put_chunk(ns, parent, toks, payload, "bfloat16", (16, 32))
        assert status.ok, status
        out[key], parent = payload.tobytes(), key
    return out


def _read_back(c: kvstore.Client, chunks: dict[bytes, bytes]) -> tuple[int, int]:
    """(lost, wrong) over every chunk."""
    lost = wrong = 0
    for key, payload in chunks.items():
        got = c.get(key)
        lost += got is None
        wrong += got is not None and bytes(got[1]) != payload
    return lost, wrong


def _warnings(srv: KVServer, word: str) -> list[str]:
    return [line for line in srv.log_path.read_text(errors="replace").splitlines() if word in line]


@pytest.mark.skipif(not available("redis"), reason="redis-server is not installed")
@pytest.mark.parametrize("fault", ["min-replicas-to-write unmet", "foreign value under kvs:sz"])
def test_redis_refusing_writes(
    make_server: Callable[..., KVServer],
    tmp_path: Path,
    record: Callable[..., Any],
    fault: str,
) -> None:
    noreplicas = fault.startswith("min-replicas")
    with RedisServer("redis") as redis:
        srv, port = _server(
            make_server,
            tmp_path,
            redis.url,
            args=["--log-level", "warning", "--sweep-interval", "0.1"],
        )
        with kvstore.Client(srv.unix_url, shm=False) as c:
            assert _remote(c).healthy and _reaches_remote(c, "refuse-before")
            if noreplicas:
                redis.cli("CONFIG", "SET", "min-replicas-to-write", "1")
            else:
                redis.cli("SET", "kvs:sz", "some other application's value")
            chunks = _chunks(c, fault, CHUNKS)
            detect_s = wait_for(
                lambda: not _remote(c).healthy and _remote(c).detail.get("degraded"),
                5.0,
                "Stats to report the refusing remote tier degraded",
            )
            metric_down = _metric_healthy(port)
            refused_metric = _metric(
                port, 'kvstore_tier_detail{name="writes_refused",tier="remote"}'
            )
            before = _remote(c).detail
            time.sleep(REFUSING_S)  # 30 sweeps, each of which retried the backlog before
            during = _remote(c).detail
            tries = during["writes_refused"] - before["writes_refused"]
            # While a probe of the refusing tier runs, its retries are out of the backlog
            # (they come back refused a moment later): one sample may find it empty.
            deadline = time.monotonic() + 2.0
            while not during["backlog"] and time.monotonic() < deadline:
                time.sleep(0.02)
                during = _remote(c).detail
            lost, wrong = _read_back(c, chunks)
            logged = _warnings(srv, "NOREPLICAS" if noreplicas else "WRONGTYPE")
            if noreplicas:
                redis.cli("CONFIG", "SET", "min-replicas-to-write", "0")
            else:
                redis.cli("DEL", "kvs:sz")
            t_fix = time.monotonic()
            wait_for(lambda: _remote(c).healthy, 10.0, "the tier to be healthy after the fix")
            wait_for(
                lambda: all(3 in t for t in c.exists(list(chunks))),
                15.0,
                "the chunks refused meanwhile to reach Redis",
            )
            recovery_s = time.monotonic() - t_fix
            metric_up = _metric_healthy(port)
            after = _remote(c).detail
        record(
            "Remote tier",
            f"Redis refusing writes: {fault}",
            f"{CHUNKS} chunks put while Redis answers every write with an error "
            f"({'NOREPLICAS' if noreplicas else 'WRONGTYPE'}); {REFUSING_S:.0f} s of sweeps "
            "every 0.1 s; then the fault removed",
            faults=1,
            requests=CHUNKS * 2,
            lost=lost,
            wrong=wrong,
            recovery_s=recovery_s,
            notes=f"degraded in Stats after {detect_s:.2f} s; {during['writes_refused']} writes "
            f"refused in all, {tries} during the {REFUSING_S:.0f} s of sweeps; "
            f"{len(logged)} warning(s) logged; backlog {during.get('backlog')} "
            f"(dropped {during.get('backlog_dropped')}); recovery = fix to every chunk in Redis",
        )
        assert lost == 0 and wrong == 0, (lost, wrong)
        assert metric_down == 0.0 and metric_up == 1.0, (metric_down, metric_up)
        assert refused_metric > 0, "refused writes do not reach /metrics"
        assert during["refused"] > 0 and during["last_refusal"], during
        # Before: every sweep re-read, re-encoded and re-sent up to 256 refused copies.
        assert tries <= REFUSING_S / 0.5 + 2, f"{tries} tries in {REFUSING_S} s: {during}"
        assert during["writes_skipped"] > 0, during
        assert 0 < during["backlog"] <= CHUNKS + 1, during
        assert 1 <= len(logged) <= 2, f"refusals must be logged, rate-limited: {logged}"
        assert after["backlog"] == 0 and not after["degraded"], after
        assert srv.stop() == 0, srv.log()


# -- records planted in Redis without the key ------------------------------------------


@pytest.mark.skipif(not available("redis"), reason="redis-server is not installed")
def test_forged_record_refused_by_servers_with_the_key(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    import redis as redis_py

    from kvstore.keys import chunk_key, tokens_to_bytes
    from kvstore.records import Codec, encode

    key_file = tmp_path / "remote.key"
    key_file.write_text("a3f1" * 16 + "\n")
    key_file.chmod(0o600)
    keyed = f'auth_key_file = "{key_file}"\n'
    with RedisServer("redis") as redis:
        a, _ = _server(make_server, tmp_path, redis.url, name="keyed", remote=keyed)
        a2, _ = _server(make_server, tmp_path, redis.url, name="keyed2", remote=keyed)
        b, _ = _server(make_server, tmp_path, redis.url, name="plain")
        ns = Namespace(model="faults-forged", dtype="bfloat16")
        planted = redis_py.Redis.from_url(redis.url)
        with (
            kvstore.Client(a.unix_url, shm=False) as ca,
            kvstore.Client(a2.unix_url, shm=False) as ca2,
            kvstore.Client(b.unix_url, shm=False) as cb,
        ):
            genuine = _chunks(ca, "genuine", 4)
            wait_for(lambda: all(3 in t for t in ca.exists(list(genuine))), 5.0, "L3 copies")
            served = {
                "keyed peer": _read_back(ca2, genuine),
                "plain peer": _read_back(cb, genuine),
            }
            forged: dict[bytes, bytes] = {}
            blobs: dict[bytes, bytes] = {}
            for i in range(4):
                toks = [900_000 + 16 * i + j for j in range(16)]
                key = chunk_key(ROOT, ns.fingerprint, tokens_to_bytes(toks))
                forged[key] = bytes(range(256)) * 4  # "poisoned" KV, every checksum right
                blob = encode(
                    key=key,
                    parent=ROOT,
                    fingerprint=ns.fingerprint,
                    token_bytes=tokens_to_bytes(toks),
                    dtype="bfloat16",
                    shape=(16, 32),
                    payload=forged[key],
                    codec=Codec.ZSTD_SHUFFLE,
                )
                blobs[key] = blob
                planted.set(f"kvs:c:{key.hex()}", blob)
            refused = [ca.get(k) is None for k in forged]
            left = [planted.exists(f"kvs:c:{k.hex()}") for k in forged]
            detail = _remote(ca).detail
            for k, blob in blobs.items():  # planted again: the keyed server deleted them
                planted.set(f"kvs:c:{k.hex()}", blob)
            plain_served = sum(
                (got := cb.get(k)) is not None and bytes(got[1]) == v for k, v in forged.items()
            )
        planted.close()
        record(
            "Security",
            "records forged in Redis",
            "3 servers share one Redis, 2 with remote.auth_key_file, 1 without; 4 genuine "
            "chunks written through a keyed server; 4 self-consistent records (kvstore's own "
            "packing, without the key) planted with redis-py",
            faults=len(forged),
            requests=4 * 2 + len(forged) * 2,
            wrong=sum(not r for r in refused),
            notes=f"keyed server: {sum(refused)} of {len(forged)} forged records refused "
            f"(counted as forged, deleted); genuine records read back (lost, wrong): keyed "
            f"peer {served['keyed peer']}, plain peer {served['plain peer']}; the server "
            f"without the key served {plain_served} of {len(forged)} forged records (the "
            "documented limit)",
        )
        assert all(refused), f"a server with the key served a forged record: {refused}"
        assert detail["forged"] == len(forged) and detail["authenticated"], detail
        assert left == [0] * len(forged), "forged records are deleted"
        assert served == {"keyed peer": (0, 0), "plain peer": (0, 0)}, served
        assert plain_served == len(forged), "without the key a forged record is served"
        for srv in (a, a2, b):
            assert "a3f1a3f1" not in srv.log(), "the key must never be logged"
            assert srv.stop() == 0, srv.log()
