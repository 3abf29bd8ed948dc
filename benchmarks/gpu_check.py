"""GPU check for the connector's CUDA path: run it on a machine with an NVIDIA GPU.

    python benchmarks/gpu_check.py [--json out.json] [--skip-vllm]

1. Copy bandwidth, device -> host, for 1-64 MiB: into pageable memory, into a
   pinned torch buffer, and into kvstore's shared-memory arena registered with
   cudaHostRegister (what a same-host engine writes into). The arena should
   reach the pinned figure; pageable is the floor it must beat.
2. The connector with vLLM on CUDA (skipped with --skip-vllm or when vLLM is not
   installed): a small random Llama, a kvstore-server, the same prompt twice;
   checks the second run loads from kvstore and produces the same tokens.

Figures are ratios to the pinned-buffer copy measured in the same run.
Not yet run on a GPU here: the CUDA path is untested until this script has run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bandwidth(copy: Any, nbytes: int, reps: int = 10) -> float:
    import torch

    copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def copy_bandwidth() -> list[dict[str, Any]]:
    import torch

    from kvstore.config import MemoryConfig
    from kvstore.tiers.memory import MemoryTier

    records: list[dict[str, Any]] = []
    sizes = [1 << 20, 8 << 20, 64 << 20]
    tier = MemoryTier(MemoryConfig(capacity_bytes=256 << 20))
    try:
        import numpy as np

        from kvstore.tiers.arena import ArenaView

        view = ArenaView.open(tier.path)
        arena = torch.from_numpy(np.asarray(view.array))
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        registered = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        for n in sizes:
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
            pageable = torch.empty(n, dtype=torch.uint8)
            pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            dst = arena[:n]
            limit = _bandwidth(lambda p=pinned, s=src: p.copy_(s, non_blocking=True), n)
            for name, fn in [("pageable", lambda p=pageable, s=src: p.copy_(s)),
                             ("arena", lambda d=dst, s=src: d.copy_(s, non_blocking=True))]:
                v = _bandwidth(fn, n)
                records.append({"name": f"d2h {name} {n >> 20} MiB", "value": v, "unit": "GB/s",
                                "limit": limit, "ratio": v / limit,
                                "notes": f"arena registered: {registered}"})
            assert torch.equal(dst.cuda(), src), "bytes copied into the arena differ"
        if registered:
            cudart.cudaHostUnregister(arena.data_ptr())
        view.close()
    finally:
        tier.close()
    return records


def connector_run(work: Path) -> dict[str, Any]:
    from tests.connectors.tinymodel import make_tiny_llama

    model = make_tiny_llama(work / "model", layers=8, hidden=1024, heads=16, kv_heads=4)
    sock = work / "kv.sock"
    server = subprocess.Popen([sys.executable, "-m", "kvstore.server.main", "--listen", "",
                               "--unix-socket", str(sock), "--data-dir", str(work / "data"),
                               "--memory-capacity", "4GiB"])
    try:
        time.sleep(3)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=False, gpu_memory_utilization=0.5, max_model_len=9000,
                  kv_transfer_config={"kv_connector": "KVStoreConnector",
                                      "kv_connector_module_path": "kvstore.connectors.vllm",
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"url": f"unix://{sock}"}})
        prompt = TokensPrompt(prompt_token_ids=[random.randrange(10, 1000) for _ in range(8192)])
        params = SamplingParams(temperature=0.0, max_tokens=8)
        times, outs = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            outs.append(llm.generate([prompt], params, use_tqdm=False)[0])
            times.append(time.perf_counter() - t0)
        return {"cold_s": times[0], "warm_s": times[1],
                "loaded_tokens": outs[1].num_cached_tokens,
                "same_tokens": outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids}
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "copy": copy_bandwidth()}
    for r in out["copy"]:
        print(f"{r['name']:<28} {r['value']:7.2f} GB/s  {r['ratio']:.2f} of pinned  {r['notes']}")
    if not args.skip_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vLLM not installed: skipping the connector run")
        else:
            with tempfile.TemporaryDirectory() as d:
                out["connector"] = connector_run(Path(d))
            print("connector:", out["connector"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = all(r["ratio"] > 0 for r in out["copy"])
    conn = out.get("connector")
    if conn is not None:
        ok = ok and conn["same_tokens"] and conn["loaded_tokens"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
