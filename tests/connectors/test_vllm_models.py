"""Model families other than a dense Llama: what the connector does with them.

- Recurrent state (Mamba, linear attention): refused at start, whatever vLLM makes of
  the model, before anything is stored or loaded (``vllm_namespace``). A pure Mamba
  model reached the connector as one group of ``MambaSpec`` blocks, which it took as
  KV; with a server chunk size matching vLLM's block size (the state's) it would have
  stored and served one request's state as another prompt's prefix.
- Sliding-window + full attention (Gemma 3, gpt-oss style) through vLLM's hybrid memory
  allocator (the connector is ``SupportsHMA``): one KV-cache group per kind, each stored
  under keys of its own, a sliding-window group's records holding only the blocks a hit
  at their end reads. One engine stores, a fresh one loads; a tiny random Gemma 3.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvstore.connectors.vllm_meta import record_blocks
from kvstore.connectors.vllm_namespace import engine_groups, engine_namespace

import kvstore
from kvstore.errors import ConfigError
from kvstore.testing.server import KVServer

REPO = Path(__file__).resolve().parents[2]
PHASES = Path(__file__).with_name("phases.py")
TOL = 5e-3  # max |logprob difference| between loaded and recomputed KV (as the e2e tests)


def _vllm_config() -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.float32),
        cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


def _groups(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(specs)]
    )


def test_recurrent_state_is_refused_at_start() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mamba = MambaSpec(block_size=4096, shapes=((3, 512), (16, 512)), dtypes=(torch.float32,) * 2)
    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    # Alone (pure Mamba), or beside attention as vLLM's hybrid allocator hands Jamba over.
    for groups in (_groups(mamba), _groups(full, mamba)):
        for worker in (False, True):
            with pytest.raises(
                ConfigError, match="kvstore stores attention KV only: this model keeps MambaSpec"
            ):
                engine_namespace(_vllm_config(), groups, "", worker=worker)


def test_attention_layouts_are_taken() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    kw: dict[str, Any] = dict(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    for spec in (FullAttentionSpec(**kw), SlidingWindowSpec(**kw, sliding_window=256)):
        ns = engine_namespace(_vllm_config(), _groups(spec), "", worker=False)
        assert type(spec).__name__ in ns.base.layout
    # MLA too: its loads and its one copy for every TP rank, tests/connectors/test_vllm_mla.py.
    mla = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.float32)
    ns = engine_namespace(_vllm_config(), _groups(mla), "", worker=False)
    assert "MLAAttentionSpec" in ns.base.layout


def test_hybrid_groups_have_keys_of_their_own() -> None:
    """Each group's namespace describes every group's layout and differs by the group, so
    a sliding-window group's short records are never read as a full group's."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    kw: dict[str, Any] = dict(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    config = _groups(SlidingWindowSpec(**kw, sliding_window=128), FullAttentionSpec(**kw))
    ns = engine_namespace(_vllm_config(), config, "", worker=False)
    assert "SlidingWindowSpec" in ns.base.layout and "FullAttentionSpec" in ns.base.layout
    assert "window=128" in ns.base.layout, ns.base.layout
    fps = {ns.fingerprint, ns.of_group(0).fingerprint, ns.of_group(1).fingerprint}
    assert len(fps) == 3, "the groups' keys must differ from each other and the engine's"
    assert [g.window for g in engine_groups(config)] == [128, 0]
    chunked = ChunkedLocalAttentionSpec(**kw, attention_chunk_size=256)
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec"):
        engine_namespace(
            _vllm_config(), _groups(chunked, FullAttentionSpec(**kw)), "", worker=False
        )


def test_a_window_record_holds_what_a_hit_at_its_end_reads() -> None:
    """vLLM keeps, once c tokens are computed, the blocks from the one holding token
    c - W + 1; a record of [s, e) must hold those for c = e and c = e - 1 (a prompt
    stored to its end is loaded one token short), and no more."""
    bs = 128
    assert record_blocks(bs, 0, 256, 512) == (2, 4)  # full attention: every block
    assert record_blocks(bs, 128, 256, 512) == (3, 4)  # tokens 384..511: one block
    assert record_blocks(bs, 129, 256, 512) == (2, 4)  # at 511 token 383 is still read
    assert record_blocks(bs, 256, 256, 512) == (2, 4)
    assert record_blocks(bs, 1024, 256, 512) == (2, 4)  # never before the chunk's start
    assert record_blocks(bs, 128, 512, 640) == (4, 5)


def make_tiny_gemma3(out: Path, window: int = 256) -> Path:
    """A random Gemma 3 text model: three sliding-window layers, one full."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        # Gemma scales its embeddings by sqrt(hidden): at the range our Llama uses, one
        # token takes every logit whatever the prompt, and wrong KV would go unnoticed.
        initializer_range=0.02,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    return out


def _run(
    work: Path,
    name: str,
    model: Path,
    phases: list[Any],
    kv: dict[str, Any],
    llm: dict[str, Any] | None = None,
) -> list[Any]:
    spec, out, log = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    run = {"model": str(model), "phases": phases, "kv_transfer_config": kv, "llm": llm or {}}
    spec.write_text(json.dumps(run))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, str(PHASES), "--spec", str(spec), "--out", str(out)],
            stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900, check=False,
        ).returncode  # fmt: skip
    assert rc == 0, f"engine {name} failed (rc={rc}):\n{log.read_text()[-6000:]}"
    return [p["results"] for p in json.loads(out.read_text())["phases"]]


def _worst(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for sa, sb in zip(a["logprobs"], b["logprobs"], strict=True):
        db = dict((t, lp) for t, lp in sb)
        worst = max([worst, *(abs(lp - db[t]) for t, lp in sa if t in db)])
    return worst


BLOCK_BYTES = 2 * 2 * 64 * 128 * 4  # K and V, 2 KV heads, head size 64, 128 tokens, fp32


def test_hybrid_model_stores_each_group_and_only_the_window(tmp_path: Path) -> None:
    """A tiny Gemma 3 (window 128, gpt-oss's) with vLLM's hybrid allocator on: one engine
    computes and stores four prompts past the window, a fresh one loads them and must
    give the first one's tokens and logprobs. Each KV-cache group is stored under its
    own keys; a sliding-window group's records hold one block (the 128 tokens before
    their end) and the fresh engine reads only the records at the hit point. A chunk
    one window group lost in between shortens that prompt's hit for every group."""
    model = make_tiny_gemma3(tmp_path / "gemma3", window=128)
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (600, 700, 512, 580)]
    srv = KVServer(tmp_path, "models", memory="256MiB").start()
    try:
        kv = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": srv.unix_url},
        }
        (computed,) = _run(tmp_path, "store", model, [prompts], kv)
        with kvstore.Client(srv.unix_url) as c:
            # One window group loses the last prompt's second chunk: that prompt's hit is
            # its first chunk, the prefix every group can still serve.
            cut = _second_chunk_of_one_window_group(c, prompts[3])
            assert c.delete([cut]) == 1
        (loaded,) = _run(tmp_path, "load", model, [prompts], kv)
        with kvstore.Client(srv.unix_url) as c:
            stats = c.stats()
            chunks = [ch for ch in c.list() if ch.key != cut]
            assert c.exists([cut])[0], "the cut chunk was computed and stored again"
    finally:
        assert srv.stop() == 0, srv.log()
    log = (tmp_path / "store.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log, "vLLM turned HMA off"
    assert "4 KV-cache groups (windows [128, 128, 128, 0])" in log, log[-3000:]
    assert [r["num_cached_tokens"] for r in computed] == [0, 0, 0, 0]
    # The 512-token prompt is loaded to its end, one token short (vLLM computes one); the
    # last one only to its first chunk's end.
    assert [r["num_cached_tokens"] for r in loaded] == [512, 512, 511, 256], "hits per prompt"
    assert computed[0]["logprobs"][0] != computed[1]["logprobs"][0], (
        "the model answers both prompts alike: it cannot tell loaded KV from wrong KV"
    )
    for i, (c, lo) in enumerate(zip(computed, loaded, strict=True)):
        assert lo["token_ids"] == c["token_ids"], f"prompt {i}: loaded KV generated other tokens"
        assert _worst(lo, c) < TOL, f"prompt {i}: logprobs differ by {_worst(lo, c)}"
    assert stats.hits > 0, stats

    # Per group (fingerprint): each prompt is stored as chunks [0,256) [256,512) (a hybrid
    # model stores whole chunks only); the fresh engine's hits are at 512 (511).
    by_fp: dict[bytes, list[Any]] = {}
    for ch in chunks:
        by_fp.setdefault(bytes(ch.fingerprint), []).append(ch)
    assert sorted(len(v) for v in by_fp.values()) == [7, 8, 8, 8], (
        "8 chunks in each of 4 groups (one cut)"
    )
    full = [v for v in by_fp.values() if all(ch.raw_size == 2 * BLOCK_BYTES for ch in v)]
    assert len(full) == 1, "one group (the full-attention layer) stores every block"
    window = [v for v in by_fp.values() if v is not full[0]]
    for v in window:
        sizes = sorted(ch.raw_size for ch in v)
        assert set(sizes) == {BLOCK_BYTES}, f"a window group stored {sizes}, not one block a chunk"

    # (is a first chunk, was read): the full group's hits read every chunk up to them; a
    # window group's only the record ending at the hit (the first chunk of the prompt whose
    # hit was cut, the second of the others): the records before it, outside the window,
    # are not read.
    def reads(v: list[Any]) -> list[tuple[bool, bool]]:
        return sorted((ch.parent == bytes(32), ch.hits > 0) for ch in v)

    cut_one = [(False, False)] + [(False, True)] * 3
    assert reads(full[0]) == cut_one + [(True, True)] * 4, reads(full[0])
    firsts = [(True, False)] * 3 + [(True, True)]
    cut_group = [(False, True)] * 3 + firsts  # (its cut chunk, stored again, left out)
    expect = sorted([cut_group, cut_one + firsts, cut_one + firsts])
    assert sorted(reads(v) for v in window) == expect, [reads(v) for v in window]


def _second_chunk_of_one_window_group(c: Any, prompt: list[int]) -> bytes:
    """The key of the prompt's second chunk in one sliding-window group (its records hold
    one block): the groups' namespaces are the server's fingerprints."""
    from kvstore.keys import Fingerprint, chunk_keys

    stored = {bytes(ch.key): ch for ch in c.list()}
    for fp in sorted({bytes(ch.fingerprint) for ch in stored.values()}):
        key = bytes(chunk_keys(Fingerprint(fp), prompt, 256)[1])
        if key in stored and stored[key].raw_size == BLOCK_BYTES:
            return key
    raise AssertionError("no window group holds the prompt's second chunk")


def test_sliding_window_and_full_attention_model_without_hma(tmp_path: Path) -> None:
    """With vLLM's hybrid allocator turned off (``--disable-hybrid-kv-cache-manager``)
    every layer keeps full KV in one ``FullAttentionSpec`` group, stored as a dense
    model's. Phase 1 computes and stores two prompts longer than the window; phase 2
    loads them (prefix cache off) and must give phase 1's tokens and logprobs."""
    model = make_tiny_gemma3(tmp_path / "gemma3")
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (600, 700)]
    srv = KVServer(tmp_path, "models", memory="256MiB").start()
    try:
        kv = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": srv.unix_url},
        }
        no_hma = {"disable_hybrid_kv_cache_manager": True}
        computed, loaded = _run(tmp_path, "gemma3", model, [prompts, prompts], kv, no_hma)
        with kvstore.Client(srv.unix_url) as c:
            stats = c.stats()
    finally:
        assert srv.stop() == 0, srv.log()
    log = (tmp_path / "gemma3.log").read_text()
    assert "block128/FullAttentionSpec/layers4/" in log, "vLLM was to give every layer full KV"
    assert [r["num_cached_tokens"] for r in computed] == [0, 0]
    assert [r["num_cached_tokens"] for r in loaded] == [512, 640], "both must load whole blocks"
    assert computed[0]["logprobs"][0] != computed[1]["logprobs"][0], (
        "the model answers both prompts alike: it cannot tell loaded KV from wrong KV"
    )
    for i, (c, lo) in enumerate(zip(computed, loaded, strict=True)):
        assert lo["token_ids"] == c["token_ids"], f"prompt {i}: loaded KV generated other tokens"
        assert _worst(lo, c) < TOL, f"prompt {i}: logprobs differ by {_worst(lo, c)}"
    assert stats.hits > 0, stats


def test_payload_layers_go_in_forward_order() -> None:
    """A payload's layers are in the forward pass's order (layers.2 before layers.10), so
    a load copied layer by layer keeps ahead of the forward pass. Past ten layers that
    order is not plain sorted order, which payloads stored before used: such a model's
    keys change, so none of those is read in the new order; a model of ten layers or
    fewer keeps its keys."""
    from kvstore.connectors.vllm_namespace import layer_order
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(12)]
    assert layer_order(reversed(names)) == names
    assert sorted(names) != names
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)

    def layout(n: int) -> str:
        config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(names[:n], spec)])
        return str(engine_namespace(_vllm_config(), config, "", worker=False).base.layout)

    assert "layers-by-number" in layout(12), layout(12)
    assert "layers-by-number" not in layout(10), "a 10-layer model's keys must not change"
