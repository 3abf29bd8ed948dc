"""Run a tiny vLLM engine on token-id prompts and report greedy tokens + logprobs.

Two ways to use it:

- in-process: ``run_llm(model_dir, prompts, kv_transfer_config=...)`` builds one
  ``vllm.LLM``, generates, shuts it down and returns one ``dict`` per prompt;
- in a fresh process (what tests should do, one engine at a time):
  ``run_llm_subprocess(...)`` runs this file as a script and reads its JSON.
  A fresh process per engine is the only reliable way to free everything an
  ``LLM`` holds (engine-core process, KV cache, connector state).

CLI::

    python tests/connectors/run_llm.py --model DIR --prompts prompts.json \
        --out out.json [--kv-transfer-config '{"kv_connector": ...}'] [--dtype float32]

``prompts.json`` is a list of lists of token ids. The output JSON is
``{"results": [...], "timings": {...}}`` where each result is
``{"token_ids": [...], "logprobs": [[[tok, lp], ...top-k...], ...per step],
"num_cached_tokens": int}``.

vLLM spawns processes, so any script that calls ``run_llm`` in-process needs an
``if __name__ == "__main__":`` guard (this one has it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_LOGPROBS = 5

# Set before vllm is imported anywhere in this process (and inherited by the
# engine-core process it spawns). 1 GiB of KV cache is plenty for a tiny model.
_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Keep the two shared cores for the engine; more threads only thrash.
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
}


def _set_env() -> None:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def run_llm(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    max_tokens: int = 8,
    logprobs: int = DEFAULT_LOGPROBS,
    dtype: str = "float32",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = False,
    skip_tokenizer_init: bool = True,
    gpu_memory_utilization: float = 0.3,
    block_size: int | None = None,
    log_stats: bool = False,
    single_process: bool = False,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Build one LLM, generate greedily for each prompt, return results + timings.

    Prefix caching is off by default so that a second request with the same
    prompt gets its KV from the connector, not from vLLM's own cache.

    ``log_stats=True`` turns vLLM's stat logging on, flushes it once after
    generating (the offline ``LLM`` only logs every ``VLLM_LOG_STATS_INTERVAL``
    seconds, so a short run may otherwise log nothing: the flush is what prints
    "External prefix cache hit rate" and the connector's "KV Transfer metrics"
    line), and returns vLLM's counters and gauges under ``"metrics"``
    (e.g. ``vllm:external_prefix_cache_hits``).

    ``single_process=True`` runs the engine core and the worker inside this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): about 20 s
    less per engine here, and both connector halves are separate instances in
    one process. Keep at least one test in the default (three-process) mode:
    only it proves the connector module imports in spawned processes.
    """
    _set_env()
    if single_process:
        # vllm.envs reads os.environ lazily, so this works until the LLM is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching,
        seed=0,
        disable_log_stats=not log_stats,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if block_size is not None:
        kwargs["block_size"] = block_size
    kwargs.update(llm_kwargs)

    t1 = time.perf_counter()
    llm = LLM(**kwargs)
    t2 = time.perf_counter()
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    t3 = time.perf_counter()

    metrics: dict[str, float] = {}
    if log_stats:
        llm.llm_engine.do_log_stats()
        for m in llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, int | float):
                metrics[m.name] = metrics.get(m.name, 0) + value

    results = []
    for out in outs:
        comp = out.outputs[0]
        steps = []
        for step in comp.logprobs or []:
            # Sort by (-logprob, id) so top-k order is stable when values tie.
            pairs = sorted(
                ((int(t), float(lp.logprob)) for t, lp in step.items()), key=lambda p: (-p[1], p[0])
            )
            steps.append([[t, lp] for t, lp in pairs])
        results.append(
            {
                "token_ids": [int(t) for t in comp.token_ids],
                "logprobs": steps,
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    # Best effort: stop the engine-core process now rather than at interpreter exit.
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    return {
        "results": results,
        "metrics": metrics,
        "timings": {
            "import_s": t1 - t0,
            "construct_s": t2 - t1,
            "generate_s": t3 - t2,
            "total_s": t3 - t0,
        },
    }


def run_llm_subprocess(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    workdir: str | os.PathLike[str],
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``run_llm`` in a fresh Python process; return its JSON output.

    ``kwargs`` are ``run_llm``'s keyword arguments (JSON-serialisable).
    ``env`` is merged into the child's environment (e.g. PYTHONPATH so the
    engine's spawned processes can import an out-of-tree connector module).
    Raises ``RuntimeError`` with the tail of the child's log when it fails.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    n = len(list(work.glob("run_*.json")))
    prompts_path = work / f"prompts_{n}.json"
    out_path = work / f"run_{n}.json"
    log_path = work / f"run_{n}.log"
    prompts_path.write_text(json.dumps(prompts))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts_path),
        "--out",
        str(out_path),
        "--kwargs",
        json.dumps(kwargs),
    ]
    child_env = {**os.environ, **_ENV_DEFAULTS, **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, timeout=timeout, check=False
        )
    log_text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(
            f"run_llm child failed (rc={proc.returncode}); log {log_path}:\n{log_text[-4000:]}"
        )
    data: dict[str, Any] = json.loads(out_path.read_text())
    data["log"] = str(log_path)
    return data


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Max |lp_a - lp_b| over every (prompt, step, token) present in both runs."""
    worst = 0.0
    for ra, rb in zip(a["results"], b["results"], strict=True):
        for sa, sb in zip(ra["logprobs"], rb["logprobs"], strict=False):
            da, db = dict((t, lp) for t, lp in sa), dict((t, lp) for t, lp in sb)
            for t in da.keys() & db.keys():
                worst = max(worst, abs(da[t] - db[t]))
    return worst


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-transfer-config", default=None, help="JSON dict")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--kwargs", default="{}", help="JSON dict of extra run_llm kwargs")
    args = ap.parse_args(argv)

    kwargs: dict[str, Any] = json.loads(args.kwargs)
    if args.kv_transfer_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.max_tokens is not None:
        kwargs["max_tokens"] = args.max_tokens
    prompts = json.loads(Path(args.prompts).read_text())
    data = run_llm(args.model, prompts, **kwargs)
    Path(args.out).write_text(json.dumps(data))
    for i, r in enumerate(data["results"]):
        first = r["logprobs"][0][0] if r["logprobs"] else None
        print(
            f"prompt {i}: tokens={r['token_ids']} cached={r['num_cached_tokens']} top1[0]={first}"
        )
    print("timings:", json.dumps({k: round(v, 2) for k, v in data["timings"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
