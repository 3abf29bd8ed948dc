"""The remote tier (L3) goes away under load and comes back.

Builds on tests/tiers/test_remote.py (the tier alone: breaker, deadlines, a dead
cluster node) and tests/test_store_remote.py (the store keeps serving L1/L2): here
a real kvstore-server serves 8 clients while Redis is stopped and started again,
or a Valkey cluster node goes away. Every call must still be answered in time
(no client error, no slow call), the tier must show as unhealthy in Stats and in
the Prometheus metrics, and once it is back, new chunks must reach it again.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
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


def _server(make_server: Callable[..., KVServer], tmp_path: Path, url: str) -> tuple[KVServer, int]:
    config = tmp_path / "remote.toml"
    config.write_text(
        f'[remote]\nurl = "{url}"\ntimeout_ms = 200\nconnect_timeout_ms = 200\n'
        "retries = 1\nfailure_threshold = 2\ncooldown_ms = 500\n"
    )
    port = free_port()
    srv = make_server(
        "remote",
        args=[
            "--config",
            str(config),
            "--chunk-tokens",
            "16",
            "--granularity",
            "4",
            "--metrics-port",
            str(port),
            "--log-level",
            "error",
        ],
    ).start()
    return srv, port


def _remote(c: kvstore.Client) -> Any:
    return next(t for t in c.stats().tiers if t.name == "remote")


def _metric_healthy(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('kvstore_tier_healthy{tier="remote"}'):
                return float(line.split()[-1])
    raise AssertionError("no kvstore_tier_healthy metric for the remote tier")


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
