"""Scale-out: three kvstore-servers (separate data dirs and arenas, as three hosts run them)
sharing one 3-node Valkey cluster as L3. A prefix stored through one server is a hit
through the other two, byte for byte; with a cluster node gone, the others answer within
their deadlines with what is left (shorter prefixes, misses), never an error."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.keys import ROOT, ChunkKey, Namespace
from kvstore.testing.redis import ServerCluster, available
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus

pytestmark = pytest.mark.skipif(not available("valkey"), reason="valkey-server missing")

CHUNK = 256  # the servers' default chunk_tokens
CHUNKS = 12
WIDTH = 2048  # float16 values per token: 1 MiB a chunk, so chunks spread over the nodes
NS = Namespace("scale/model", dtype="float16")
REMOTE_ENV = {
    "KVSTORE_REMOTE_CODEC": "raw",
    "KVSTORE_REMOTE_TIMEOUT_MS": "1000",
    "KVSTORE_REMOTE_CONNECT_TIMEOUT_MS": "500",
    "KVSTORE_REMOTE_COOLDOWN_MS": "300",
}


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[ServerCluster, list[KVServer]]]:
    with ServerCluster(3, "valkey") as cluster:
        servers = [
            KVServer(
                tmp_path / f"host{i}",
                f"kv{i}",
                args=["--remote", cluster.url],
                env=REMOTE_ENV,
                memory="64MiB",
            )
            for i in range(3)
        ]
        try:
            for s in servers:
                s.start()
            yield cluster, servers
        finally:
            for s in servers:
                if s.proc is not None and s.proc.poll() is None:
                    assert s.stop() == 0, f"{s.name} did not shut down cleanly:\n{s.log()}"


def prompt(seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, CHUNKS * CHUNK)
    kv = [rng.standard_normal((CHUNK, WIDTH)).astype(np.float16) for _ in range(CHUNKS)]
    return tokens, kv


def store(client: kvstore.Client, tokens: np.ndarray, kv: list[np.ndarray]) -> list[ChunkKey]:
    keys, parent = [], ROOT
    for i, block in enumerate(kv):
        parent, status = client.put_chunk(
            NS, parent, tokens[i * CHUNK : (i + 1) * CHUNK], block, "float16", block.shape
        )
        assert status is PutStatus.STORED, status
        keys.append(parent)
    return keys


def wait_matched(client: kvstore.Client, tokens: np.ndarray, want: int) -> kvstore.LookupResult:
    """Until a lookup matches ``want`` tokens (the write-through to L3 is asynchronous)."""
    deadline = time.monotonic() + 20
    while True:
        hit = client.lookup(NS, tokens)
        if hit.matched_tokens >= want or time.monotonic() > deadline:
            return hit
        time.sleep(0.05)


def test_a_prefix_stored_through_one_server_is_a_hit_through_the_others(
    hosts: tuple[ServerCluster, list[KVServer]],
) -> None:
    _, servers = hosts
    clients = [kvstore.Client(s.unix_url) for s in servers]
    try:
        tokens, kv = prompt(1)
        keys = store(clients[0], tokens, kv)
        for i in (1, 2):
            hit = wait_matched(clients[i], tokens, len(tokens))
            assert hit.matched_tokens == len(tokens), (
                f"server {i} sees {hit.matched_tokens} of {len(tokens)} tokens stored through "
                f"server 0 ({hit.stop}); its log:\n{servers[i].log()}"
            )
            assert hit.by_tier.get(3) == len(tokens), f"server {i} should find it in L3: {hit}"
            out = np.empty((CHUNK, WIDTH), np.float16)
            for key, block in zip(keys, kv, strict=True):
                got = clients[i].get_into(key, out)
                assert got is not None, f"server {i}: chunk {key.hex()[:12]} missing"
                assert np.array_equal(out, block), f"server {i}: chunk {key.hex()[:12]} differs"
            again = clients[i].lookup(NS, tokens)
            assert again.by_tier.get(1) == len(tokens), f"hits were not promoted to L1: {again}"
        # A prompt that shares the first half: every server reports the shared prefix.
        half = CHUNKS // 2 * CHUNK
        other = np.concatenate([tokens[:half], np.arange(90_000, 90_000 + half)])
        for c in clients:
            assert c.lookup(NS, other).matched_tokens == half
    finally:
        for c in clients:
            c.close()


def test_a_cluster_node_gone_costs_hits_never_errors(
    hosts: tuple[ServerCluster, list[KVServer]],
) -> None:
    cluster, servers = hosts
    clients = [kvstore.Client(s.unix_url) for s in servers]
    try:
        tokens, kv = prompt(2)
        keys = store(clients[0], tokens, kv)
        assert wait_matched(clients[1], tokens, len(tokens)).matched_tokens == len(tokens)
        cluster.stop_node(1)
        out = np.empty((CHUNK, WIDTH), np.float16)
        hits, slowest = 0, 0.0
        for key, block in zip(keys, kv, strict=True):  # server 2 has none of them in L1
            t0 = time.monotonic()
            got = clients[2].get_into(key, out)
            slowest = max(slowest, time.monotonic() - t0)
            if got is not None:
                hits += 1
                assert np.array_equal(out, block), "a hit with a node gone served other bytes"
        # two attempts of 1 s and a backoff at most per read; slack for a busy machine
        assert slowest < 4.0, f"a read took {slowest:.2f}s with a node down"
        assert hits < CHUNKS, "every chunk was found although a node holding some is gone"
        t0 = time.monotonic()
        hit = clients[2].lookup(NS, tokens)
        assert time.monotonic() - t0 < 4.0
        assert hit.matched_tokens < len(tokens), "a lookup promised chunks on the stopped node"
        # The node comes back empty (no persistence): what it held is gone for good, and
        # what is stored from now on reaches it again.
        cluster.start_node(1)
        cluster.wait_ok()
        tokens3, kv3 = prompt(3)
        deadline = time.monotonic() + 20
        keys3 = store(clients[0], tokens3, kv3)
        while clients[1].lookup(NS, tokens3).matched_tokens < len(tokens3):
            assert time.monotonic() < deadline, (
                f"a prompt stored after the node came back is not shared:\n{servers[0].log()}"
            )
            time.sleep(0.2)
        assert clients[1].get_into(keys3[-1], out) is not None and np.array_equal(out, kv3[-1])
    finally:
        for c in clients:
            c.close()
