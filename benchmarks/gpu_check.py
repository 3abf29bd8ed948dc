"""GPU check for the connector's CUDA path: run it on a machine with an NVIDIA GPU.

    python benchmarks/gpu_check.py [--json out.json] [--skip-vllm] [--skip-tests]

1. Copy bandwidth between the device and host memory, 1-64 MiB, both ways: pageable
   memory, a pinned torch buffer, and kvstore's shared-memory arena registered with
   cudaHostRegister. Pinned is the limit; pageable is the floor a save must beat.
2. The connector's data path (``BlockLayout`` and ``BackgroundSaver``, what
   ``KVStoreConnector`` runs) on a Llama-8B-shaped paged cache in vLLM's CUDA layout
   (LBNHC), against a real kvstore-server over shared memory:
   - gather (side stream, into pinned memory) and the whole save (gather + put) in GB/s,
     as a ratio to the pinned device-to-host copy;
   - how long the engine's thread is held by starting a save, against the copy's time;
   - how much a save slows a compute-bound loop on the compute stream (1.0 = not at all);
   - the load path (get into pinned memory, scatter) in GB/s against pinned host-to-device.
3. ``tests/connectors/test_blocks.py`` on CUDA: byte-exact round trips in three layouts,
   and the ordering of the side stream with the compute stream.
4. The connector inside vLLM on CUDA (skipped with --skip-vllm or without vLLM): a small
   random Llama, the same prompt twice; the second run must load and give the same tokens.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


DEVICE = "cuda"  # "cpu" with --dry-run: exercises this script's code on a machine without a GPU


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _median_s(fn: Callable[[], Any], reps: int = 10) -> float:
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _rec(name: str, value: float, unit: str, limit: float | None, notes: str = ""
         ) -> dict[str, Any]:
    return {"name": name, "value": value, "unit": unit, "limit": limit,
            "ratio": value / limit if limit else None, "notes": notes}


def copy_bandwidth() -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from kvstore.config import MemoryConfig
    from kvstore.tiers.arena import ArenaView
    from kvstore.tiers.memory import MemoryTier

    records: list[dict[str, Any]] = []
    tier = MemoryTier(MemoryConfig(capacity_bytes=256 << 20))
    try:
        view = ArenaView.open(tier.path)
        arena = torch.from_numpy(np.asarray(view.array))
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        registered = int(rc[0] if isinstance(rc, tuple) else rc) == 0
        for n in (1 << 20, 8 << 20, 64 << 20):
            dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
            hosts = {"pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
                     "pageable": torch.empty(n, dtype=torch.uint8),
                     "arena": arena[:n]}
            for way in ("d2h", "h2d"):
                def copy(h: torch.Tensor, way: str = way, d: torch.Tensor = dev) -> None:
                    (h.copy_(d, non_blocking=True) if way == "d2h"
                     else d.copy_(h, non_blocking=True))
                limit = n / _median_s(lambda h=hosts["pinned"]: copy(h)) / 1e9
                for kind, h in hosts.items():
                    v = limit if kind == "pinned" else n / _median_s(lambda h=h: copy(h)) / 1e9
                    records.append(_rec(f"{way} {kind} {n >> 20} MiB", v, "GB/s", limit,
                                        f"arena registered: {registered}"))
            arena[:n].copy_(dev)
            assert torch.equal(arena[:n].cuda(), dev), "bytes copied into the arena differ"
        if registered:
            cudart.cudaHostUnregister(arena.data_ptr())
        del arena
        view.close()
    finally:
        tier.close()
    return records


def _start_server(work: Path, memory: str) -> tuple[subprocess.Popen[bytes], str]:
    from kvstore.client import Client

    sock = work / "kv.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.server.main", "--listen", "",
                             "--unix-socket", str(sock), "--data-dir", str(work / "data"),
                             "--memory-capacity", memory, "--disk-capacity", "16GiB",
                             "--log-level", "warning"], cwd=ROOT)
    url = f"unix://{sock}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(url, timeout=1.0, shm=False) as c:
                if c.health(timeout=1.0):
                    return proc, url
        except Exception:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvstore-server did not start")


def data_path(work: Path, limits: dict[str, float]) -> list[dict[str, Any]]:
    """The connector's save and load path on a Llama-3-8B-shaped cache (LBNHC, bf16)."""
    import torch
    from kvstore.connectors.vllm_blocks import BackgroundSaver, BlockLayout

    from kvstore.client import Client
    from kvstore.keys import ROOT as KEY_ROOT
    from kvstore.keys import Namespace, chunk_key, tokens_to_bytes
    from kvstore.records import make_header

    layers, blocks, bs, heads, hd = (32, 2048, 16, 8, 128) if DEVICE == "cuda" else (4, 256, 16,
                                                                                     8, 128)
    base = torch.randn(layers, blocks, bs, heads, 2 * hd, dtype=torch.bfloat16, device=DEVICE)
    layout = BlockLayout({f"l{i:02d}": base[i].transpose(1, 2) for i in range(layers)})
    per_chunk = 16  # blocks in a 256-token chunk: 32 MiB of KV
    nbytes = layout.layers * per_chunk * layout.block_bytes
    ns = Namespace(model="gpu-check", dtype="bfloat16", layout="LBNHC")
    records: list[dict[str, Any]] = []
    d2h, h2d = limits["d2h"], limits["h2d"]

    import numpy as np

    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    memcpy = nbytes / _median_s(lambda: np.copyto(b, a)) / 1e9
    records.append(_rec("memcpy 32 MiB (one thread)", memcpy, "GB/s", None, "host limit of a put"))

    # gather alone, and the engine thread's share of it
    buf = layout.host_buffer(nbytes)
    ids = list(range(0, 2 * per_chunk, 2))
    t = _median_s(lambda: layout.gather(ids, buf)())
    records.append(_rec("save gather 32 MiB chunk", nbytes / t / 1e9, "GB/s", d2h,
                        "side stream, LBNHC, into pinned memory; limit: pinned d2h"))
    _sync()
    held = []
    for _ in range(10):
        t0 = time.perf_counter()
        wait = layout.gather(ids, buf)
        held.append(time.perf_counter() - t0)
        wait()
    held.sort()
    records.append(_rec("save: engine thread held", held[5] * 1e3, "ms", t * 1e3,
                        "time to start a 32 MiB save; limit: the whole copy's time"))

    proc, url = _start_server(work, "8GiB")
    try:
        with Client(url, timeout=30) as client:
            assert client.shm_active, "the same-host client is not using shared memory"
            chunks = 64 if DEVICE == "cuda" else 8  # 2 GiB on the GPU
            keys: list[bytes] = []

            def save(i: int, done: Callable[[], None], b: torch.Tensor) -> int:
                done()
                tok = tokens_to_bytes(list(range(i * 256, i * 256 + 256)))
                key = chunk_key(KEY_ROOT, ns.fingerprint, tok)
                payload = b.numpy()
                header = make_header(key=key, parent=KEY_ROOT, fingerprint=ns.fingerprint,
                                     token_bytes=tok, dtype="bfloat16",
                                     shape=layout.payload_shape(per_chunk),
                                     payload=memoryview(payload.data))
                keys.append(key)
                return 256 if client.put(header, payload).ok else 0

            saver = BackgroundSaver(lambda job: save(*job), max_pending_bytes=4 << 30)
            t0 = time.perf_counter()
            for i in range(chunks):
                b = layout.host_buffer(nbytes)
                sel = [(i * per_chunk + k) % blocks for k in range(per_chunk)]
                assert saver.submit((i, layout.gather(sel, b), b), nbytes)
            assert saver.drain(300)
            total = time.perf_counter() - t0
            saved, failed = saver.take()
            saver.close(5)
            rate = chunks * nbytes / total / 1e9
            note = f"{saved} tokens stored, {failed} failed; through the server's shared memory"
            assert saved == chunks * 256, note
            records.append(_rec(f"save gather+put x{chunks}", rate, "GB/s", d2h,
                                note + "; limit: pinned d2h"))
            records.append(_rec(f"save gather+put x{chunks} vs memcpy", rate, "GB/s", memcpy,
                                "a put copies into the arena and the server verifies it"))

            # compute-stream slowdown while saves run
            dim, mm_n = (8192, 40) if DEVICE == "cuda" else (512, 4)
            x = torch.randn(dim, dim, device=DEVICE, dtype=torch.bfloat16)

            def compute() -> None:
                y = x
                for _ in range(mm_n):
                    y = torch.mm(y, x)
                    y /= 90.0

            alone = _median_s(compute, reps=5)
            saver = BackgroundSaver(lambda job: save(*job), max_pending_bytes=4 << 30)
            keys.clear()
            _sync()
            # As in the engine: a step's saves start, then the next forward is queued.
            t0 = time.perf_counter()
            for i in range(8):
                b = layout.host_buffer(nbytes)
                saver.submit((1000 + i, layout.gather(list(range(i * 16, i * 16 + 16)), b), b),
                             nbytes)
            compute()
            _sync()
            both = time.perf_counter() - t0
            assert saver.drain(120)
            saver.close(5)
            records.append(_rec("compute time with saves running", both, "s", alone,
                                f"{mm_n} matmuls ({dim}^3 bf16) queued after 8 chunk saves; "
                                "ratio 1 = no slowdown"))

            # load: get into pinned memory, scatter
            dst = layout.host_buffer(nbytes)
            targets = list(range(blocks - per_chunk, blocks))
            key = keys[0]

            def load() -> None:
                assert client.get_into(key, dst.numpy()) is not None
                layout.scatter(dst, per_chunk, targets)

            t = _median_s(load)
            records.append(_rec("load get+scatter 32 MiB chunk", nbytes / t / 1e9, "GB/s",
                                h2d, "shared memory into pinned, then host-to-device"))
    finally:
        proc.terminate()
        proc.wait(30)
    return records


def run_block_tests() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/connectors/test_blocks.py"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(p.stdout[-3000:], p.stderr[-2000:])
    return {"rc": p.returncode, "summary": p.stdout.strip().splitlines()[-1:] or [""]}


def connector_run(work: Path) -> dict[str, Any]:
    from tests.connectors.tinymodel import make_tiny_llama

    model = make_tiny_llama(work / "model", layers=8, hidden=1024, heads=16, kv_heads=4)
    proc, url = _start_server(work, "4GiB")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=False, gpu_memory_utilization=0.5, max_model_len=9000,
                  kv_transfer_config={"kv_connector": "KVStoreConnector",
                                      "kv_connector_module_path": "kvstore.connectors.vllm",
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"url": url}})
        prompt = TokensPrompt(prompt_token_ids=[random.randrange(10, 1000) for _ in range(8192)])
        params = SamplingParams(temperature=0.0, max_tokens=8)
        times, outs = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            outs.append(llm.generate([prompt], params, use_tqdm=False)[0])
            times.append(time.perf_counter() - t0)
            time.sleep(1.0)  # async saves land in the background
        return {"cold_s": times[0], "warm_s": times[1],
                "loaded_tokens": outs[1].num_cached_tokens,
                "same_tokens": outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids}
    finally:
        proc.terminate()
        proc.wait(30)


def _step(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """One part of the check; a failure is recorded and the others still run."""
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:
        import traceback

        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="run the data path on CPU (checks this script without a GPU)")
    args = ap.parse_args()
    import torch

    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
        out: dict[str, Any] = {"device": "cpu (dry run)"}
        with tempfile.TemporaryDirectory() as d:
            _step(out, "data_path", lambda: data_path(Path(d), {"d2h": 1.0, "h2d": 1.0}))
        print(json.dumps(out, indent=1))
        return 0 if isinstance(out["data_path"], list) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    _step(out, "copy", copy_bandwidth)
    copies = out["copy"] if isinstance(out["copy"], list) else []
    limits = {w: max((r["limit"] for r in copies if r["name"].startswith(w)), default=0.0)
              for w in ("d2h", "h2d")}
    with tempfile.TemporaryDirectory() as d:
        _step(out, "data_path", lambda: data_path(Path(d), limits))
    for part in ("copy", "data_path"):
        for r in out[part] if isinstance(out[part], list) else [out[part]]:
            if "name" in r:
                ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
                print(f"{r['name']:<34} {r['value']:9.3f} {r['unit']:<5} ratio {ratio}  "
                      f"{r['notes']}")
            else:
                print(part, r)
    if not args.skip_tests:
        _step(out, "block_tests", run_block_tests)
    if not args.skip_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            out["connector"] = {"skipped": "vLLM is not installed on this machine"}
        else:
            with tempfile.TemporaryDirectory() as d:
                _step(out, "connector", lambda: connector_run(Path(d)))
        print("connector:", out["connector"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = all(isinstance(out.get(p), list) for p in ("copy", "data_path"))
    ok = ok and out.get("block_tests", {"rc": 0}).get("rc") == 0
    conn = out.get("connector", {})
    if "same_tokens" in conn:
        ok = ok and conn["same_tokens"] and conn["loaded_tokens"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
