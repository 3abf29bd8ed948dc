"""drop_after_load (the seed's drop_select) through the connector's halves, without an engine
(tests/connectors/halves.py), against a real kvstore-server: a producer stores prompts,
a consumer loads them and drops what it loaded, in the Release that ends the step's
leases. The P/D path with real vLLM engines is in test_vllm_connector.py; what the
server does with a chunk another client holds is in tests/server/test_client_contract.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvstore.connectors.vllm_config import ConnectorConfig

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.sdk.client import Client
from kvstore.testing.server import KVServer
from tests.connectors.halves import BS, Engine
from tests.connectors.test_connector_loads import Layout, calls_since, prompt, requests, stored

DROP = {"kvstore": {"drop_after_load": True}}
KEEP = {"kvstore": {"drop_after_load": False}}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", memory="256MiB").start()
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture
def producer(server: KVServer) -> Iterator[Engine]:
    e = Engine(server.unix_url, blocks=800, load=False)
    yield e
    e.close()


def consumer(server: KVServer, **cfg: Any) -> Engine:
    return Engine(server.unix_url, blocks=800, save=False, **cfg)


def keys_of(server: KVServer) -> set[ChunkKey]:
    with Client(server.unix_url) as c:
        return {v.key for v in c.list()}


def store(
    server: KVServer, producer: Engine, prompts: list[list[int]]
) -> tuple[list[list[int]], list[set[ChunkKey]]]:
    """Store each prompt, one after the other: its source blocks, and the keys each added."""
    lay, srcs, added = Layout(), [], []
    for p in prompts:
        before = keys_of(server)
        srcs.append(lay.take(len(p)))
        (a,) = producer.step([(p, srcs[-1])])
        assert a.told == 0, "a producer loads nothing"
        added.append(keys_of(server) - before)
    return srcs, added


def same_bytes(dst: Engine, a: list[int], src: Engine, b: list[int]) -> bool:
    return all(torch.equal(dst.cache[n][a], src.cache[n][b]) for n in dst.cache)


def stats(server: KVServer) -> Any:
    with Client(server.unix_url) as c:
        return c.stats()


def until(what: str, check: Any, timeout: float = 10.0) -> None:
    """A Release sent without waiting lands a moment after the step."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_an_engine_with_drop_after_load_drops_a_steps_chunks_in_its_one_release(
    server: KVServer, producer: Engine
) -> None:
    """Four requests of three chunks loaded in one step by a consumer with
    drop_after_load: the step costs one Release (the lookups lent the chunks: no
    AcquireMany, no Delete, no other call), the blocks hold the producer's bytes, and
    then the server holds
    none of the twelve chunks: Stats counts them dropped, a new request misses."""
    prompts = [prompt(500 + i) for i in range(4)]
    srcs, _ = store(server, producer, prompts)
    assert stats(server).chunks == 12
    c = consumer(server, drop_after_load=True)
    try:
        lay = Layout()
        dsts = [lay.take(len(p)) for p in prompts]
        before = requests(server)
        got = c.step(list(zip(prompts, dsts, strict=True)))
        assert all(a.told == stored(600) and not a.failed for a in got), got
        k = stored(600) // BS
        for src, dst in zip(srcs, dsts, strict=True):
            assert same_bytes(c, dst[:k], producer, src[:k]), "a loaded block differs"
        until("the step's Release never dropped the chunks", lambda: stats(server).chunks == 0)
        calls = calls_since(server, before)
        after = requests(server)
        assert calls["AcquireMany"] == 0 and calls["Release"] == 1, calls
        assert after.get("Delete", 0) == before.get("Delete", 0), "drops must not cost Deletes"
        s = stats(server)
        assert (s.dropped, s.drops_deferred) == (12, 0), (s.dropped, s.drops_deferred)
        again = c.step([(prompts[0], lay.take(600))])
        assert again[0].told == 0, "a dropped prompt must miss"
    finally:
        c.close()


def test_a_request_asks_for_its_drop_and_shares_nothing_it_did_not_ask_for(
    server: KVServer, producer: Engine
) -> None:
    """Per request (kv_transfer_params) on an engine that keeps by default: X drops its
    chunks, but not the first chunk it shares with Y (loaded in the same step by Y, who
    did not ask), Y's and Z's (drop_after_load false) stay; a malformed parameter is
    ignored with a warning (the engine's setting holds) and never fails the step. W
    drops the chunk it matched whole, not the stored one it matched only a prefix of
    (another prompt's)."""
    shared = prompt(600, 256)
    x, y = shared + prompt(601, 344), shared + prompt(602, 344)
    z, bad, v = prompt(603), prompt(604), prompt(605)
    w = v[:320] + prompt(606, 280)  # v's chunk 0 whole, 64 tokens of v's chunk 1
    _, added = store(server, producer, [x, y, z, bad, v])
    c = consumer(server)
    try:
        lay = Layout()
        got = c.step(
            [(p, lay.take(600)) for p in (x, y, z, bad, w)],
            params=[DROP, None, KEEP, {"kvstore": {"drop_after_load": "sometimes"}}, DROP],
        )
        assert all(a.told == stored(600) and not a.failed for a in got[:4]), got
        assert got[4].told == 320 and not got[4].failed, got[4]
        x_all = added[0]  # x's three chunks: the one it shares with y came with x
        assert len(x_all) == 3 and len(added[1]) == 2, (len(x_all), len(added[1]))
        until("x's own chunks were not dropped", lambda: stats(server).dropped >= 3)
        time.sleep(0.2)  # a wrong drop of the others would land by now
        left = keys_of(server)
        assert len(x_all - left) == 2, "x must drop its two own chunks"
        assert len(x_all & left) == 1, "the chunk y loaded too (not asking) must stay"
        assert added[1] | added[2] | added[3] <= left, "a chunk of y, z or bad was dropped"
        assert len(added[4] - left) == 1, "w drops v's first chunk, not the one it matched part of"
        assert stats(server).dropped == 3
    finally:
        c.close()


def test_a_background_load_from_disk_drops_from_every_tier(
    server: KVServer, producer: Engine
) -> None:
    """After a restart the chunks are on disk only: the consumer loads them in the
    background (the loader's own client) and drops them from L1 and L2 alike."""
    ps = [prompt(700), prompt(701)]
    srcs, _ = store(server, producer, ps)
    with Client(server.unix_url) as cl:
        until("not written to disk", lambda: all(2 in t for t in cl.exists(list(keys_of(server)))))
    server.stop(signal.SIGTERM)
    server.start()
    time.sleep(0.3)
    c = consumer(server, drop_after_load=True)
    try:
        lay = Layout()
        dsts = [lay.take(600) for _ in ps]
        got = c.step(list(zip(ps, dsts, strict=True)), wait_s=20)
        assert all(a.background and a.told == stored(600) and not a.failed for a in got), got
        k = stored(600) // BS
        for src, dst in zip(srcs, dsts, strict=True):
            assert same_bytes(c, dst[:k], producer, src[:k]), "a background load put other bytes"
        until("the background load's chunks were not dropped", lambda: stats(server).chunks == 0)
        assert stats(server).dropped == 6
    finally:
        c.close()


def test_a_consumer_without_shared_memory_drops_with_one_release_after_its_gets(
    server: KVServer, producer: Engine
) -> None:
    """shm off (a server on another host): the chunks come by Get, in the background,
    and one Release carrying only drop_keys deletes them afterwards."""
    p = prompt(800)
    srcs, _ = store(server, producer, [p])
    c = consumer(server, drop_after_load=True, shm="off")
    try:
        before = requests(server)
        dst = Layout().take(600)
        (a,) = c.step([(p, dst)], wait_s=20)
        assert a.told == stored(600) and not a.failed, (a, c.breakers())
        k = stored(600) // BS
        assert same_bytes(c, dst[:k], producer, srcs[0][:k]), "a streamed block differs"
        until("the Release with drop_keys never came", lambda: stats(server).chunks == 0)
        calls = calls_since(server, before)
        assert calls["Get"] == 3 and calls["AcquireMany"] == 0 and calls["Release"] == 1, calls
        assert stats(server).dropped == 3
    finally:
        c.close()


def test_drop_settings_are_checked() -> None:
    """The engine's drop_after_load (a request's: test_request_params.py)."""
    assert ConnectorConfig().drop_after_load is False, "off unless asked for"
    assert ConnectorConfig.parse({"drop_after_load": True}).drop_after_load is True
    with pytest.raises(ConfigError, match=r"drop_after_load=true .* load=false"):
        ConnectorConfig(drop_after_load=True, load=False)
    with pytest.raises(ConfigError, match="drop_after_load"):
        ConnectorConfig.parse({"drop_after_load": "sometimes"})
