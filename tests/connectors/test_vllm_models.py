"""Model families other than a dense Llama: what the connector does with them.

- Recurrent state (Mamba, linear attention): refused at start, whatever vLLM makes of
  the model, before anything is stored or loaded (``vllm_namespace``). A pure Mamba
  model reached the connector as one group of ``MambaSpec`` blocks, which it took as
  KV; with a server chunk size matching vLLM's block size (the state's) it would have
  stored and served one request's state as another prompt's prefix.
- Sliding-window + full attention (Gemma 3 style): vLLM turns its hybrid KV cache
  manager off for this connector (no ``SupportsHMA``) and keeps full KV for every layer
  (one group of ``FullAttentionSpec``); stored and loaded as a dense model's, the output
  equals the recomputed one. One engine, a tiny random Gemma 3 built here.
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
from kvstore.connectors.vllm_namespace import engine_namespace

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
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=4096, shapes=((3, 512), (16, 512)), dtypes=(torch.float32,) * 2)
    for worker in (False, True):
        with pytest.raises(
            ConfigError, match="kvstore stores attention KV only: this model keeps MambaSpec"
        ):
            engine_namespace(_vllm_config(), _groups(mamba), "", worker=worker)


def test_attention_layouts_are_taken() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    kw: dict[str, Any] = dict(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    for spec in (FullAttentionSpec(**kw), SlidingWindowSpec(**kw, sliding_window=256)):
        ns = engine_namespace(_vllm_config(), _groups(spec), "", worker=False)
        assert type(spec).__name__ in ns.base.layout
    # MLA fails closed: its output after a load was seen to differ from recompute.
    mla = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.float32)
    with pytest.raises(ConfigError, match="kvstore does not serve MLA models yet"):
        engine_namespace(_vllm_config(), _groups(mla), "", worker=False)


def make_tiny_gemma3(out: Path) -> Path:
    """A random Gemma 3 text model: three sliding-window layers (window 256), one full."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=256,
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


def _run(work: Path, name: str, model: Path, phases: list[Any], kv: dict[str, Any]) -> list[Any]:
    spec, out, log = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    spec.write_text(json.dumps({"model": str(model), "phases": phases, "kv_transfer_config": kv}))
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


def test_sliding_window_and_full_attention_model_loads_what_it_stored(tmp_path: Path) -> None:
    """Phase 1 computes and stores two prompts longer than the window; phase 2 loads them
    (prefix cache off) and must give phase 1's tokens and logprobs."""
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
        computed, loaded = _run(tmp_path, "gemma3", model, [prompts, prompts], kv)
        with kvstore.Client(srv.unix_url) as c:
            stats = c.stats()
    finally:
        assert srv.stop() == 0, srv.log()
    log = (tmp_path / "gemma3.log").read_text()
    assert "FullAttentionSpec" in log, "vLLM was expected to give every layer full KV"
    assert [r["num_cached_tokens"] for r in computed] == [0, 0]
    assert [r["num_cached_tokens"] for r in loaded] == [512, 640], "both must load whole blocks"
    assert computed[0]["logprobs"][0] != computed[1]["logprobs"][0], (
        "the model answers both prompts alike: it cannot tell loaded KV from wrong KV"
    )
    for i, (c, lo) in enumerate(zip(computed, loaded, strict=True)):
        assert lo["token_ids"] == c["token_ids"], f"prompt {i}: loaded KV generated other tokens"
        assert _worst(lo, c) < TOL, f"prompt {i}: logprobs differ by {_worst(lo, c)}"
    assert stats.hits > 0, stats
