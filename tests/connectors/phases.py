"""Run one vLLM engine over several phases of prompts, pausing between phases on request.

Building an engine costs about a minute on this machine, so one engine serves a
whole scenario: phase 1 stores, phase 2 hits, and between phases the test can
kill, corrupt or restart the kvstore server. With ``--sync-dir`` the driver
writes ``done-N`` after phase N and waits for ``go-N`` before phase N+1.

    python tests/connectors/phases.py --spec spec.json --out out.json [--sync-dir DIR]

spec.json: {"model": DIR, "phases": [[[tok, ...], ...], ...], "kv_transfer_config": {...}|null,
            "llm": {extra LLM kwargs}, "max_tokens": 8, "metrics": false,
            "kv_transfer_params": [{...}|null per phase]}
out.json:  {"phases": [{"results": [...], "seconds": s, "metrics": {...}}, ...]}

With ``"metrics": true`` vLLM's stats are on and each phase carries vLLM's counters as
they stand after it (``vllm:num_preemptions``, ``vllm:external_prefix_cache_hits``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _results(outs: list[Any]) -> list[dict[str, Any]]:
    results = []
    for out in outs:
        comp = out.outputs[0]
        steps = [
            sorted(
                ((int(t), float(lp.logprob)) for t, lp in step.items()), key=lambda p: (-p[1], p[0])
            )
            for step in comp.logprobs or []
        ]
        results.append(
            {
                "token_ids": [int(t) for t in comp.token_ids],
                "logprobs": steps,
                "num_cached_tokens": int(out.num_cached_tokens or 0),
            }
        )
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync-dir", default="")
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("metrics"):
        kwargs["disable_log_stats"] = False
    kwargs.update(spec.get("llm", {}))
    llm = LLM(**kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=5, ignore_eos=True
    )
    out: dict[str, Any] = {"phases": []}
    sync = Path(args.sync_dir) if args.sync_dir else None
    # Per phase, every request's kv_transfer_params (what an OpenAI request's body carries).
    per_phase = spec.get("kv_transfer_params") or []
    for i, prompts in enumerate(spec["phases"]):
        kv_params = per_phase[i] if i < len(per_phase) else None
        phase_params = params
        if kv_params is not None:
            phase_params = params.clone()
            phase_params.extra_args = {"kv_transfer_params": kv_params}
        if sync is not None and i > 0:
            (sync / f"done-{i}").write_text("")
            deadline = time.monotonic() + 600
            while not (sync / f"go-{i}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody said go-{i}")
                time.sleep(0.1)
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], phase_params, use_tqdm=False
        )
        seconds = time.perf_counter() - t0
        counters: dict[str, float] = {}
        if spec.get("metrics"):
            for m in llm.get_metrics():
                value = getattr(m, "value", None)
                if isinstance(value, int | float):
                    counters[m.name] = counters.get(m.name, 0) + value
        out["phases"].append({"results": _results(outs), "seconds": seconds, "metrics": counters})
        Path(args.out).write_text(json.dumps(out))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
