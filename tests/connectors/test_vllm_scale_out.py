"""Across hosts: a vLLM engine attached to one kvstore-server loads KV that another engine
stored through another server, the two servers sharing only a 3-node Valkey cluster (L3).

Two engines (about a minute each here): a producer on server A stores, a consumer on
server B (its own data dir and arena, nothing of A's in L1/L2) runs the same prompts and
must load them from L3 and generate what the producer computed.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import kvstore
from kvstore.testing.redis import ServerCluster, available
from kvstore.testing.server import KVServer
from kvstore.testing.tinymodel import make_tiny_llama
from tests.connectors.test_vllm_connector import PHASE_STORE, assert_same, kv_config, run_engine

pytestmark = pytest.mark.skipif(not available("valkey"), reason="valkey-server missing")

ENV = {"KVSTORE_REMOTE_CODEC": "raw", "KVSTORE_REMOTE_TIMEOUT_MS": "2000"}


def test_engine_on_another_server_loads_from_the_shared_cluster(tmp_path: Path) -> None:
    work = tmp_path / "vllm"
    make_tiny_llama(work / "model")
    with ServerCluster(3, "valkey") as cluster:
        a = KVServer(tmp_path / "host-a", "a", args=["--remote", cluster.url], env=ENV)
        b = KVServer(tmp_path / "host-b", "b", args=["--remote", cluster.url], env=ENV)
        a.start()
        b.start()
        try:
            (stored,) = run_engine(
                work, "producer", [PHASE_STORE],
                kv_config(a.unix_url, "kv_producer", save_mode="async"),
            )  # fmt: skip
            assert all(r["num_cached_tokens"] == 0 for r in stored), "a producer never loads"
            with kvstore.Client(a.unix_url) as c:
                assert c.stats().puts > 0, "the producer stored nothing"
            assert a.stop() == 0  # drains A's write-through to L3 before B looks
            (loaded,) = run_engine(
                work, "consumer", [PHASE_STORE], kv_config(b.unix_url, "kv_consumer")
            )
            assert_same(loaded, stored, "consumer on server B")
            cached = [r["num_cached_tokens"] for r in loaded]
            assert cached[0] == 512, f"A (600 tokens) must load 512 tokens from L3: {cached}"
            assert all(n >= 256 for n in cached), f"every stored prompt must hit: {cached}"
            with kvstore.Client(b.unix_url) as c:
                remote = next(t for t in c.stats().tiers if t.name == "remote")
            assert remote.hits > 0, f"server B's hits must come from L3: {remote}"
        finally:
            for s in (a, b):
                if s.proc is not None and s.proc.poll() is None:
                    s.stop(signal.SIGKILL)
