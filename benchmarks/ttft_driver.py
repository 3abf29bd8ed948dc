"""One vLLM engine that times single prompts on command (used by ``benchmarks/connector.py``).

Building an engine costs about a minute here, so the benchmark keeps one alive per
configuration and feeds it prompts over stdin; two engines can then take turns,
prompt by prompt, so noise from other tenants lands on both alike.

    python -m benchmarks.ttft_driver --spec spec.json

spec.json: {"model": DIR, "dtype": "bfloat16", "max_model_len": N, "vocab": V,
            "kv_transfer_config": {...} | null, "llm": {extra LLM kwargs}}
stdin:     one JSON command per line: {"n": tokens, "seed": s} times one prompt
           (``prompt(n, seed)``); {"reset": true} empties vLLM's own prefix cache
           (so that the next run of a prompt loads it through the connector);
           {"itl": {...}} times running decodes around a load (``itl``);
           {"quit": true} shuts the engine down.
stdout:    vLLM's log, "@@ready {}" once the engine is built, and one line
           "@@ttft {json}" per prompt: seconds, token, logprob, num_cached_tokens.

TTFT is the wall time of ``llm.generate([prompt], SamplingParams(max_tokens=1))``:
scheduling, the connector's lookup and load (or compute and save), the forward
pass, sampling and the round trip between this process and the engine core.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from .engines import MARK_READY, MARK_TTFT, emit


def prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    """``n`` random token ids; the same (n, seed) gives the same prompt in every process."""
    rng = random.Random(seed * 1_000_003 + n)
    return [rng.randrange(10, vocab) for _ in range(n)]


def itl(llm: Any, cmd: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Inter-token latency of running decodes around a load: ``decodes`` requests of
    ``decode_n``-token fresh prompts decode until each has ``before`` tokens; then a
    request for the ``load_n``-token prompt ``load_seed`` (stored in kvstore) joins the
    batch; the decodes go on until ``after`` more steps once its first token is out.

    Returns the step times (``perf_counter``) at which the decodes got a token, when
    the load request was added, and when its first token came (``token``,
    ``num_cached_tokens``). One engine step gives every running decode one token, so
    the gaps between those times are the decodes' inter-token latencies.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    seed = int(cmd["seed"])
    ids = [f"itl-decode-{seed}-{k}" for k in range(int(cmd["decodes"]))]
    for k, rid in enumerate(ids):
        toks = prompt(int(cmd["decode_n"]), seed + k, vocab)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=toks), long)
    load_id = f"itl-load-{seed}"
    counts = dict.fromkeys(ids, 0)
    steps: list[float] = []
    added = done = 0.0
    out: dict[str, Any] = {}
    after = 0
    while after < int(cmd["after"]):
        outs = engine.step()
        now = time.perf_counter()
        fresh = False
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if o.request_id.startswith(load_id):
                if n and not done:
                    done = now
                    out["token"] = int(o.outputs[0].token_ids[0])
                    out["num_cached_tokens"] = int(o.num_cached_tokens or 0)
            elif o.request_id in counts and n > counts[o.request_id]:
                counts[o.request_id] = n
                fresh = True
        if fresh and min(counts.values()) > 0:
            steps.append(now)
        if not added and min(counts.values()) >= int(cmd["before"]):
            load = TokensPrompt(
                prompt_token_ids=prompt(int(cmd["load_n"]), int(cmd["load_seed"]), vocab)
            )
            engine.add_request(load_id, load, SamplingParams(temperature=0.0, max_tokens=1))
            added = time.perf_counter()
        if done and fresh:
            after += 1
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return out | {"steps": steps, "added": added, "done": done}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = int(spec["max_model_len"])
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=max_len,
        # The whole prompt in one step: ExampleConnector breaks under chunked prefill.
        max_num_batched_tokens=max_len,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        # Off, so a warm prompt can only hit through the connector.
        enable_prefix_caching=False,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    kwargs.update(spec.get("llm", {}))
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, ignore_eos=True)
    vocab = int(spec.get("vocab", 1024))
    emit(MARK_READY, {})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("reset"):
            emit(MARK_TTFT, {"reset": bool(llm.reset_prefix_cache())})
            continue
        if cmd.get("itl"):
            emit(MARK_TTFT, itl(llm, cmd["itl"], vocab))
            continue
        tokens = TokensPrompt(prompt_token_ids=prompt(int(cmd["n"]), int(cmd["seed"]), vocab))
        t0 = time.perf_counter()
        outs = llm.generate([tokens], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        comp = outs[0].outputs[0]
        token = int(comp.token_ids[0])
        logprob = float(comp.logprobs[0][token].logprob) if comp.logprobs else 0.0
        emit(
            MARK_TTFT,
            {
                "seconds": seconds,
                "token": token,
                "logprob": logprob,
                "num_cached_tokens": int(outs[0].num_cached_tokens or 0),
            },
        )
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
