"""vLLM with kvstore, end to end, on this machine: the same long prompt twice.

    .venv/bin/python examples/quickstart.py [--tokens 4096] [--url unix:///path]

No model hub is needed: a small random Llama is written to a temp directory.
Without --url the connector starts a private kvstore-server for the engine (the
embedded default: shared-memory L1 + LMDB L2) and stops it at exit. The first
request computes the prompt's KV and stores it; the second loads it and only
computes what is left. Prefix caching is off so the hit comes from kvstore.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length")
    ap.add_argument("--url", default="", help="a running kvstore-server (default: a private one)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstore.testing.tinymodel import make_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvstore-quickstart-"))
    model = make_tiny_llama(
        work / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=8,
        kv_heads=4,
        max_position_embeddings=max(4096, args.tokens + 64),
    )
    extra = {"url": args.url} if args.url else {"data_dir": str(work / "kvstore-data")}
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.tokens + 64,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
        kv_transfer_config={
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )
    prompt = TokensPrompt(prompt_token_ids=[random.randrange(10, 1000) for _ in range(args.tokens)])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times, outs = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0])
        times.append(time.perf_counter() - t0)
    same = outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    print(f"\nprompt of {args.tokens} tokens")
    print(f"  cold (computed):        TTFT {times[0]:.3f} s")
    print(
        f"  warm (loaded, kvstore): TTFT {times[1]:.3f} s, {outs[1].num_cached_tokens} tokens "
        f"loaded, {times[0] / times[1]:.1f}x faster, same first token: {same}"
    )
    return 0 if same and outs[1].num_cached_tokens > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
