"""A hybrid model's KV-cache groups through the connector's halves, without an engine:
a full-attention group and a sliding-window group, each with its own block table over
the same paged cache, against a real kvstore-server.

- saves: each group's chunks under its own keys, the window group's records holding
  only the blocks a hit at their end reads;
- loads: every group's blocks restored, the window group's only inside its window at
  the hit (blocks before it are vLLM's null block and stay untouched), in the
  background;
- a failed load is reported per request (vLLM raises on block ids with several groups)
  and the request is not loaded again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_meta import KVStoreMeta, Setup
from kvstore.connectors.vllm_namespace import EngineNamespace, Group
from kvstore.connectors.vllm_scheduler import KVStoreScheduler
from kvstore.connectors.vllm_worker import KVStoreWorker

import kvstore
from kvstore.keys import Namespace
from kvstore.testing.server import KVServer
from tests.connectors.test_blocks import make_cache

BS = 16
WINDOW = 40  # tokens: a hit at 512 reads tokens 473..511, blocks 29..31
NS = EngineNamespace(Namespace(model="test/hybrid", dtype="bfloat16", layout="test"))
GROUPS = (Group(("model.layers.0.attn",), 0), Group(("model.layers.1.attn",), WINDOW))
PROMPT = list(range(100, 700))  # 600 tokens: whole chunks [0,256) [256,512)
FULL_IDS = list(range(1, 39))  # group 0's blocks for the prompt (block 0: the null block)
WINDOW_IDS = list(range(41, 79))  # group 1's


class Blocks:
    def __init__(self, *ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


class Half:
    """One engine's scheduler and worker halves over one cache (fresh: zeros)."""

    def __init__(self, url: str, fill: str, groups: tuple[Group, ...] = GROUPS) -> None:
        config = ConnectorConfig(url=url, timeout_ms=3000, lookup_timeout_ms=2000)
        sched = BreakerClient(config, url, role="scheduler")
        work = BreakerClient(config, url, role="worker")
        window = groups[0].window if len(groups) == 1 else 0  # as the facade sets it
        setup = Setup(
            config,
            NS,
            BS,
            sched.chunk_tokens(BS),
            producer=True,
            consumer=True,
            groups=groups,
            window=window,
        )
        self.scheduler = KVStoreScheduler(setup, sched)
        self.worker = KVStoreWorker(setup, work)
        self.cache = make_cache("cpu", "LBHNC", layers=2, blocks=96, block_size=BS, fill=fill)
        self.worker.register_kv_caches(self.cache)

    def step(self, new: list[tuple[str, tuple[list[int], ...], int, int]]) -> Any:
        output = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=rid, block_ids=ids, num_computed_tokens=done)
                for rid, ids, done, _ in new
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={rid: n for rid, _, _, n in new},
            preempted_req_ids=set(),
            finished_req_ids=set(),
        )
        meta = self.scheduler.build_connector_meta(output)
        assert isinstance(meta, KVStoreMeta)
        self.worker.start_load_kv(meta)
        for name in sorted(self.cache):  # the forward pass: each layer waits for its own
            self.worker.wait_for_layer_load(name)
        self.worker.wait_for_save(meta)
        return meta

    def wait_loaded(self, rid: str) -> tuple[set[str], set[int]]:
        """Empty steps until the worker reports the request's background load: what vLLM
        gets as failed_recving and as invalid block ids."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.step([])
            _, recving = self.worker.get_finished(set())
            failed = self.worker.take_failed_requests()
            invalid = self.worker.get_block_ids_with_load_errors()
            if recving and rid in recving:
                self.scheduler.update_connector_output(
                    SimpleNamespace(
                        finished_recving=recving, failed_recving=failed, invalid_block_ids=invalid
                    )
                )
                return failed, invalid
            time.sleep(0.01)
        raise AssertionError(f"the background load of {rid} was never reported")

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _request(rid: str) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=PROMPT, num_tokens=len(PROMPT))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", memory="256MiB").start()
    try:
        yield s
    finally:
        assert s.stop() == 0, s.log()


@pytest.fixture
def stored(server: KVServer) -> Iterator[Half]:
    """The prompt computed and stored by one engine (its cache random)."""
    src = Half(server.unix_url, "random")
    try:
        req = _request("store")
        assert src.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        src.scheduler.update_state_after_alloc(req, Blocks(FULL_IDS, WINDOW_IDS), 0)
        meta = src.step([("store", (FULL_IDS, WINDOW_IDS), 0, len(PROMPT))])
        assert sorted((s.group, len(s.tokens)) for s in meta.saves) == [(0, 512), (1, 512)], (
            "a hybrid model stores whole chunks only, each group its own"
        )
        yield src
    finally:
        src.close()


def _load(dst: Half, rid: str) -> Any:
    """A new request of the prompt in ``dst``: its hit, planned (not run yet)."""
    req = _request(rid)
    n, background = dst.scheduler.get_num_new_matched_tokens(req, 0)
    assert (n, background) == (512, True), "a hybrid hit is the whole chunks, in the background"
    # vLLM allocates the window group's blocks before its window as the null block.
    skipped = (512 - WINDOW + 1) // BS
    dst.scheduler.update_state_after_alloc(
        req, Blocks(FULL_IDS, [0] * skipped + WINDOW_IDS[skipped:]), n
    )
    return req


def test_each_group_is_stored_apart_and_a_window_group_only_its_window(
    stored: Half, server: KVServer
) -> None:
    with kvstore.Client(server.unix_url) as c:
        by_fp: dict[bytes, list[int]] = {}
        for ch in c.list():
            by_fp.setdefault(bytes(ch.fingerprint), []).append(ch.raw_size)
    block = stored.worker.layout.block_bytes if stored.worker.layout else 0
    # Full group: 16 blocks a chunk. Window 40: the blocks from the one holding token e-40
    # (e-1 and e both hits): [216, 256) is blocks 13..15, [472, 512) blocks 29..31.
    assert sorted(sorted(v) for v in by_fp.values()) == [[3 * block] * 2, [16 * block] * 2]


def test_a_hit_restores_every_group_and_only_the_window(stored: Half, server: KVServer) -> None:
    dst = Half(server.unix_url, "zeros")
    try:
        _load(dst, "load")
        dst.step([])  # the load starts in the background
        failed, invalid = dst.wait_loaded("load")
        assert (failed, invalid) == (set(), set())
        src, out = stored.cache, dst.cache
        full, win = "model.layers.0.attn", "model.layers.1.attn"
        assert torch.equal(out[full][FULL_IDS[:32]], src[full][FULL_IDS[:32]]), (
            "the full group's 32 blocks must be loaded"
        )
        assert torch.equal(out[win][WINDOW_IDS[29:32]], src[win][WINDOW_IDS[29:32]]), (
            "the window at 512 (blocks 29..31) must be loaded"
        )
        assert not out[win][WINDOW_IDS[:29]].any(), "blocks before the window were written"
        assert not out[win][0].any() and not out[full][0].any(), "the null block was written"
        stats = dst.worker.get_stats()
        assert stats is not None and stats.data.get("loaded_tokens") == 512, stats
    finally:
        dst.close()


def test_a_failed_load_is_reported_per_request_and_not_retried(
    stored: Half, server: KVServer
) -> None:
    dst = Half(server.unix_url, "zeros")
    try:
        _load(dst, "load")
        with kvstore.Client(server.unix_url) as c:  # gone between the lookup and the load
            window_fp = dst.scheduler.setup.for_group(1).ns.fingerprint
            keys = [ch.key for ch in c.list() if bytes(ch.fingerprint) == window_fp]
            assert c.delete(keys) == 2
        dst.step([])
        failed, invalid = dst.wait_loaded("load")
        # vLLM raises on invalid block ids with several KV-cache groups: per request only.
        assert (failed, invalid) == ({"load"}, set())
        again = _request("load")
        assert dst.scheduler.get_num_new_matched_tokens(again, 0) == (0, False), (
            "a request whose load failed must compute, not load again"
        )
    finally:
        dst.close()


def test_a_model_windowed_on_every_layer_loads_only_the_window(server: KVServer) -> None:
    """One sliding-window group (Mistral 7B v0.1 style, no HMA needed): its records hold
    the window's blocks, a hit (in the step: one group) loads only those, and vLLM's null
    block before the window is never written."""
    one = (Group(("model.layers.0.attn", "model.layers.1.attn"), WINDOW),)
    src, dst = Half(server.unix_url, "random", one), Half(server.unix_url, "zeros", one)
    try:
        req = _request("store")
        assert src.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        src.scheduler.update_state_after_alloc(req, Blocks(WINDOW_IDS), 0)
        meta = src.step([("store", (WINDOW_IDS,), 0, len(PROMPT))])
        assert [len(s.tokens) for s in meta.saves] == [512], "whole chunks only"
        with kvstore.Client(server.unix_url) as c:
            sizes = sorted(ch.raw_size for ch in c.list())
        layout = src.worker.layout
        assert layout is not None
        assert sizes == [layout.nbytes(3)] * 2, f"records of {sizes} bytes, not 3 blocks each"

        req = _request("load")
        assert dst.scheduler.get_num_new_matched_tokens(req, 0) == (512, False)
        skipped = (512 - WINDOW + 1) // BS
        table = [0] * skipped + WINDOW_IDS[skipped:]
        dst.scheduler.update_state_after_alloc(req, Blocks(table), 512)
        meta = dst.step([("load", (table,), 512, len(PROMPT) - 512)])
        assert [(s.start, s.end, s.block_ids) for s in meta.loads] == [
            (29 * BS, 512, WINDOW_IDS[29:32])
        ], "only the window's blocks are to be loaded"
        assert dst.worker.get_block_ids_with_load_errors() == set()
        for name in one[0].layers:
            a, b = dst.cache[name], src.cache[name]
            assert torch.equal(a[WINDOW_IDS[29:32]], b[WINDOW_IDS[29:32]]), f"{name}: window"
            assert not a[WINDOW_IDS[:29]].any(), f"{name}: blocks before the window written"
            assert not a[0].any(), f"{name}: the null block was written"
    finally:
        dst.close()
        src.close()
