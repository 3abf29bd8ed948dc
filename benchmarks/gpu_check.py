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
   - the load path (get into pinned memory, scatter) in GB/s against pinned host-to-device,
     and the connector's: a step's chunks under one AcquireMany, copied host-to-device
     straight from the registered arena on the side stream (target >= 0.8 of pinned h2d);
   - saves written in place, as the connector does on the server's host: a batch
     reserved in one round trip, the device copying straight into the registered arena,
     the pages hashed once the copy landed, the checksum sealed at Commit;
     checked byte for byte.
3. ``tests/connectors/test_blocks.py`` on CUDA: byte-exact round trips in three layouts,
   and the ordering of the side stream with the compute stream.
4. The connector inside vLLM on CUDA (skipped with --skip-vllm or without vLLM): a small
   random Llama, the same prompt twice; the second run must load and give the same tokens.
"""

from __future__ import annotations

import argparse
import functools
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

if __package__:
    from .harness import checkout_of
else:  # run by path (python benchmarks/gpu_check.py): this folder is sys.path[0]
    from harness import checkout_of

ROOT = checkout_of()  # the checkout the block tests run from; None for an installed copy


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


def _rec(
    name: str, value: float, unit: str, limit: float | None, notes: str = ""
) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "limit": limit,
        "ratio": value / limit if limit else None,
        "notes": notes,
    }


def copy_bandwidth() -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from kvstore.arena import ArenaView
    from kvstore.config import MemoryConfig
    from kvstore.engine.tiers.memory import MemoryTier

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
            hosts = {
                "pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
                "pageable": torch.empty(n, dtype=torch.uint8),
                "arena": arena[:n],
            }
            for way in ("d2h", "h2d"):

                def copy(h: torch.Tensor, way: str = way, d: torch.Tensor = dev) -> None:
                    (
                        h.copy_(d, non_blocking=True)
                        if way == "d2h"
                        else d.copy_(h, non_blocking=True)
                    )

                limit = n / _median_s(functools.partial(copy, hosts["pinned"])) / 1e9
                for kind, h in hosts.items():
                    t = _median_s(functools.partial(copy, h))
                    v = limit if kind == "pinned" else n / t / 1e9
                    records.append(
                        _rec(
                            f"{way} {kind} {n >> 20} MiB",
                            v,
                            "GB/s",
                            limit,
                            f"arena registered: {registered}",
                        )
                    )
            arena[:n].copy_(dev)
            assert torch.equal(arena[:n].cuda(), dev), "bytes copied into the arena differ"
        if registered:
            cudart.cudaHostUnregister(arena.data_ptr())
        del arena
        view.close()
    finally:
        tier.close()
    return records


def _start_server(
    work: Path, memory: str, policy: str = "write-through"
) -> tuple[subprocess.Popen[bytes], str]:
    from kvstore.sdk.client import Client

    sock = work / "kv.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.server.main",
            "--listen",
            "",
            "--unix-socket",
            str(sock),
            "--data-dir",
            str(work / "data"),
            "--memory-capacity",
            memory,
            "--disk-capacity",
            "16GiB",
            "--write-policy",
            policy,
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
    )
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


class _Cache:
    """A Llama-3-8B-shaped paged cache in vLLM's CUDA layout (LBNHC, bf16)."""

    def __init__(self) -> None:
        import torch
        from kvstore.connectors.vllm_blocks import BlockLayout

        from kvstore.keys import Namespace

        big = DEVICE == "cuda"
        self.layers, self.blocks = (32, 2048) if big else (4, 256)
        base = torch.randn(
            self.layers, self.blocks, 16, 8, 256, dtype=torch.bfloat16, device=DEVICE
        )
        self.layout = BlockLayout(
            {f"l{i:02d}": base[i].transpose(1, 2) for i in range(self.layers)}
        )
        self.per_chunk = 16  # blocks in a 256-token chunk: 32 MiB of KV
        self.nbytes = self.layout.nbytes(self.per_chunk)
        self.ns = Namespace(model="gpu-check", dtype="bfloat16", layout="LBNHC")
        dim = 8192 if big else 512
        self.mm_n = 40 if big else 4
        self.x = torch.randn(dim, dim, device=DEVICE, dtype=torch.bfloat16)
        self.dim = dim

    def compute(self) -> None:
        """A compute-bound stand-in for a forward pass, queued on the compute stream."""
        import torch

        y = self.x
        for _ in range(self.mm_n):
            y = torch.mm(y, self.x)
            y /= 90.0

    def chunk_ids(self, i: int) -> list[int]:
        return [(i * self.per_chunk + k) % self.blocks for k in range(self.per_chunk)]


def gather_figures(c: _Cache, limits: dict[str, float]) -> list[dict[str, Any]]:
    """The save's device side: gather speed, and how long it holds the engine's thread."""
    import numpy as np

    layout, nbytes = c.layout, c.nbytes
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    memcpy = nbytes / _median_s(lambda: np.copyto(b, a)) / 1e9
    limits["memcpy"] = memcpy
    records = [_rec("memcpy 32 MiB (one thread)", memcpy, "GB/s", None, "host limit of a put")]
    buf = layout.host_buffer(nbytes)
    ids = list(range(0, 2 * c.per_chunk, 2))
    t = _median_s(lambda: layout.gather(ids, buf)())
    records.append(
        _rec(
            "save gather 32 MiB chunk",
            nbytes / t / 1e9,
            "GB/s",
            limits["d2h"],
            "side stream, LBNHC, into pinned memory; limit: pinned d2h",
        )
    )
    forward = _median_s(c.compute, reps=5)
    held = []
    for _ in range(5):
        _sync()
        c.compute()  # the step's forward is queued when wait_for_save starts the saves
        t0 = time.perf_counter()
        wait = layout.gather(ids, buf)
        held.append(time.perf_counter() - t0)
        wait()
    held.sort()
    records.append(
        _rec(
            "save start: engine thread held",
            held[2] * 1e3,
            "ms",
            forward * 1e3,
            "starting a 32 MiB save behind a queued forward; limit: the forward's "
            "time (a blocking save would hold the thread that long)",
        )
    )
    return records


def server_figures(
    work: Path, c: _Cache, limits: dict[str, float], policy: str
) -> list[dict[str, Any]]:
    """Saves and loads through a real kvstore-server over shared memory."""
    import torch
    import xxhash
    from kvstore.connectors.vllm_blocks import BackgroundSaver

    from kvstore.keys import ROOT as KEY_ROOT
    from kvstore.keys import chunk_key, tokens_to_bytes
    from kvstore.records import make_header
    from kvstore.sdk.client import Client

    layout, nbytes, ns = c.layout, c.nbytes, c.ns
    records: list[dict[str, Any]] = []
    proc, url = _start_server(work, "8GiB", policy)
    try:
        with Client(url, timeout=30) as client:
            assert client.shm_active, "the same-host client is not using shared memory"
            keys: list[bytes] = []
            stage: dict[str, list[float]] = {"header": [], "put": []}

            def save(i: int, done: Callable[[], None], b: torch.Tensor) -> int:
                done()
                tok = tokens_to_bytes(list(range(i * 256, i * 256 + 256)))
                key = chunk_key(KEY_ROOT, ns.fingerprint, tok)
                payload = b.numpy()
                t0 = time.perf_counter()
                header = make_header(
                    key=key,
                    parent=KEY_ROOT,
                    fingerprint=ns.fingerprint,
                    token_bytes=tok,
                    dtype="bfloat16",
                    shape=layout.payload_shape(c.per_chunk),
                    payload=memoryview(payload.data),
                )
                t1 = time.perf_counter()
                ok = client.put(header, payload).ok
                stage["header"].append(t1 - t0)
                stage["put"].append(time.perf_counter() - t1)
                keys.append(key)
                return 256 if ok else 0

            chunks = 32 if DEVICE == "cuda" else 8
            saver = BackgroundSaver(lambda job: save(*job), max_pending_bytes=4 << 30)
            t0 = time.perf_counter()

            def job(i: int) -> tuple[int, Callable[[], None], torch.Tensor]:
                b = layout.host_buffer(nbytes)
                return i, layout.gather(c.chunk_ids(i), b), b

            for i in range(chunks):
                assert saver.submit(lambda i=i: job(i), nbytes)
            assert saver.drain(300)
            total = time.perf_counter() - t0
            saved, failed = saver.take()
            saver.close(5)
            rate = chunks * nbytes / total / 1e9
            note = f"{policy}; {saved} tokens stored, {failed} failed"
            assert saved == chunks * 256, note
            records.append(
                _rec(
                    f"save x{chunks} gather+put [{policy}]",
                    rate,
                    "GB/s",
                    limits["memcpy"],
                    note + "; limit: memcpy",
                )
            )
            for name, ts in stage.items():
                ts.sort()
                records.append(
                    _rec(
                        f"save stage {name} [{policy}]",
                        ts[len(ts) // 2] * 1e3,
                        "ms",
                        None,
                        "median per 32 MiB chunk while saves stream",
                    )
                )

            # compute-stream slowdown while saves run
            alone = _median_s(c.compute, reps=5)
            saver = BackgroundSaver(lambda job: save(*job), max_pending_bytes=4 << 30)
            _sync()
            t0 = time.perf_counter()
            for i in range(8):  # as in the engine: a step's saves start, then the next forward
                saver.submit(lambda i=i: job(1000 + i), nbytes)
            c.compute()
            _sync()
            both = time.perf_counter() - t0
            assert saver.drain(120)
            saver.close(5)
            records.append(
                _rec(
                    f"forward time with saves running [{policy}]",
                    both,
                    "s",
                    alone,
                    f"{c.mm_n} matmuls ({c.dim}^3 bf16) queued after 8 chunk "
                    "saves; ratio 1 = no slowdown",
                )
            )

            # loads, once the server is idle again, stage by stage
            time.sleep(3)
            dst = layout.host_buffer(nbytes)
            targets = list(range(c.blocks - c.per_chunk, c.blocks))
            key = keys[-1]
            t_get = _median_s(lambda: client.get_into(key, dst.numpy()))
            t_sum = _median_s(lambda: xxhash.xxh3_64_intdigest(dst.numpy()))
            t_scatter = _median_s(lambda: layout.scatter(dst, c.per_chunk, targets))
            total = t_get + t_scatter
            records.append(
                _rec(
                    f"load get+scatter 32 MiB [{policy}]",
                    nbytes / total / 1e9,
                    "GB/s",
                    limits["memcpy"],
                    f"get_into {t_get * 1e3:.1f} ms (of which checksum "
                    f"{t_sum * 1e3:.1f} ms), scatter {t_scatter * 1e3:.1f} ms; "
                    "limit: memcpy",
                )
            )
            t_put = []
            for i in range(5):
                b = layout.host_buffer(nbytes)
                layout.gather(c.chunk_ids(2000 + i), b)()
                t0 = time.perf_counter()
                save(2000 + i, lambda: None, b)
                t_put.append(time.perf_counter() - t0)
                time.sleep(0.5)
            t_put.sort()
            records.append(
                _rec(
                    f"save put 32 MiB, server idle [{policy}]",
                    nbytes / t_put[2] / 1e9,
                    "GB/s",
                    limits["memcpy"],
                    "header checksum + Reserve/copy/Commit; limit: memcpy",
                )
            )
    finally:
        proc.terminate()
        proc.wait(30)
    return records


def in_place_figures(work: Path, c: _Cache, limits: dict[str, float]) -> list[dict[str, Any]]:
    """What the connector does on the server's host: a step's chunks reserved in one
    round trip, the blocks copied by the device straight into the registered arena,
    the pages hashed once the copy landed, their checksum sealed at Commit.
    Checked byte for byte against a staged copy."""
    import numpy as np
    import torch
    from kvstore.connectors.vllm_blocks import PinnedArenas

    from kvstore.keys import ROOT as KEY_ROOT
    from kvstore.sdk.client import Client, Reservation, chunk_header

    layout, nbytes, ns = c.layout, c.nbytes, c.ns
    shape = layout.payload_shape(c.per_chunk)
    records: list[dict[str, Any]] = []
    proc, url = _start_server(work, "8GiB", "write-back")
    pins = PinnedArenas()
    try:
        with Client(url, timeout=30) as client:
            assert client.shm_active, "the same-host client is not using shared memory"
            chunks = 16 if DEVICE == "cuda" else 4
            headers = [
                chunk_header(
                    ns, KEY_ROOT, np.arange(256) + 256 * (5000 + i), None, "bfloat16", shape
                )
                for i in range(chunks)
            ]
            t0 = time.perf_counter()
            got = client.reserve(headers)
            t_reserve = time.perf_counter() - t0
            held = [r for r in got if isinstance(r, Reservation)]
            assert len(held) == chunks, f"reservations refused: {got}"
            pinned = DEVICE != "cuda" or pins.pin(held[0].arena)
            assert pinned, "cudaHostRegister of the client's arena mapping failed"
            t1 = time.perf_counter()
            waits = []
            for i, res in enumerate(held):
                view = res.contiguous()
                assert view is not None, "a fresh arena hands out one extent per record"
                waits.append(layout.gather(c.chunk_ids(3000 + i), torch.from_numpy(view)))
            t_start = time.perf_counter() - t1
            for wait in waits:
                wait()
            stored = [res.commit() for res in held]
            total = time.perf_counter() - t0
            assert all(st.ok for st in stored), stored
            rate = chunks * nbytes / total / 1e9
            records.append(
                _rec(
                    f"save x{chunks} in place (reserve, d2h into arena, commit)",
                    rate,
                    "GB/s",
                    limits["memcpy"],
                    f"ReserveMany {t_reserve * 1e3:.1f} ms; starting the copies held "
                    f"the thread {t_start * 1e3:.1f} ms; limit: memcpy",
                )
            )
            want, out = layout.host_buffer(nbytes), np.empty(nbytes, np.uint8)
            for i in (0, chunks - 1):
                layout.gather(c.chunk_ids(3000 + i), want)()
                assert client.get_into(headers[i].key, out) is not None
                assert np.array_equal(out, want.numpy()), f"chunk {i}: other bytes came back"
            records += arena_load_figures(client, c, [h.key for h in headers], pins, limits)
    finally:
        pins.close()
        proc.terminate()
        proc.wait(30)
    return records


def arena_load_figures(
    client: Any, c: _Cache, keys: list[bytes], pins: Any, limits: dict[str, float]
) -> list[dict[str, Any]]:
    """The connector's load path (``vllm_loads``): a step's chunks leased with one
    AcquireMany and copied from the arena into their blocks: on CUDA one host-to-device
    transfer per chunk straight from the registered arena on the side stream
    (``BlockLayout.load_cuda``), the compute stream waiting only for those, the pages
    hashed on the host meanwhile; on CPU (a dry run) verified as they land. Checked
    byte for byte against the blocks the chunks were gathered from."""
    import numpy as np
    import torch
    import xxhash

    from kvstore.sdk.shm import LeaseBase

    layout = c.layout
    targets = [
        list(range(c.blocks - (i + 1) * c.per_chunk, c.blocks - i * c.per_chunk))
        for i in range(len(keys))
    ]

    def load() -> tuple[float, float]:
        t0 = time.perf_counter()
        leases = client.acquire_many(keys, verify=True)
        t_acquire = time.perf_counter() - t0
        events = []
        for lease, ids in zip(leases, targets, strict=True):
            assert isinstance(lease, LeaseBase), f"not lent: {lease}"
            if DEVICE == "cuda":
                assert pins.pin(client.arena), "cudaHostRegister of the arena failed"
                src = np.frombuffer(lease.views()[0], dtype=np.uint8)
                events.append(layout.load_cuda(src, c.per_chunk, ids))
                ok = xxhash.xxh3_64_intdigest(lease.views()[0]) == lease.header.payload_checksum
            else:
                pieces = layout.pieces(c.per_chunk, 0, ids)
                assert pieces is not None, "the test cache is one allocation"
                ok = lease.read_scattered(layout.flat, pieces)
            assert ok, "a leased payload did not verify"
        for event in events:
            layout.wait_on_compute(event)
        _sync()
        total = time.perf_counter() - t0
        client.release_later(leases)
        return total, t_acquire

    load()
    runs = sorted(load() for _ in range(5))
    total, t_acquire = runs[2]
    nbytes = len(keys) * c.nbytes
    for i, ids in enumerate(targets):
        src = c.chunk_ids(3000 + i)
        for view in layout.views:
            assert torch.equal(view[ids], view[src]), f"chunk {i}: the loaded blocks differ"
    limit = limits.get("h2d") if DEVICE == "cuda" else limits.get("memcpy")
    return [
        _rec(
            f"load x{len(keys)} from the arena (AcquireMany, {DEVICE} copy)",
            nbytes / total / 1e9,
            "GB/s",
            limit,
            f"{nbytes >> 20} MiB; AcquireMany {t_acquire * 1e3:.1f} ms; limit: "
            + ("pinned h2d (target >= 0.8)" if DEVICE == "cuda" else "memcpy"),
        )
    ]


def data_path(work: Path, limits: dict[str, float]) -> list[dict[str, Any]]:
    c = _Cache()
    records = gather_figures(c, limits)
    for policy in ("write-through", "write-back"):
        records += server_figures(work / policy, c, limits, policy)
    records += in_place_figures(work / "in-place", c, limits)
    return records


def run_block_tests() -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/connectors/test_blocks.py",
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(p.stdout[-3000:], p.stderr[-2000:])
    return {"rc": p.returncode, "summary": p.stdout.strip().splitlines()[-1:] or [""]}


def connector_run(work: Path) -> dict[str, Any]:
    from kvstore.testing.tinymodel import make_tiny_llama

    model = make_tiny_llama(work / "model", layers=8, hidden=1024, heads=16, kv_heads=4)
    proc, url = _start_server(work, "4GiB")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            enforce_eager=True,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.5,
            max_model_len=9000,
            kv_transfer_config={
                "kv_connector": "KVStoreConnector",
                "kv_connector_module_path": "kvstore.connectors.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"url": url},
            },
        )
        prompt = TokensPrompt(prompt_token_ids=[random.randrange(10, 1000) for _ in range(8192)])
        params = SamplingParams(temperature=0.0, max_tokens=8)
        times, outs = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            outs.append(llm.generate([prompt], params, use_tqdm=False)[0])
            times.append(time.perf_counter() - t0)
            time.sleep(1.0)  # async saves land in the background
        return {
            "cold_s": times[0],
            "warm_s": times[1],
            "loaded_tokens": outs[1].num_cached_tokens,
            "same_tokens": outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids,
        }
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
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="run the data path on CPU (checks this script without a GPU)",
    )
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
    limits = {
        w: max((r["limit"] for r in copies if r["name"].startswith(w)), default=0.0)
        for w in ("d2h", "h2d")
    }
    with tempfile.TemporaryDirectory() as d:
        _step(out, "data_path", lambda: data_path(Path(d), limits))
    for part in ("copy", "data_path"):
        for r in out[part] if isinstance(out[part], list) else [out[part]]:
            if "name" in r:
                ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
                print(
                    f"{r['name']:<34} {r['value']:9.3f} {r['unit']:<5} ratio {ratio}  {r['notes']}"
                )
            else:
                print(part, r)
    if not args.skip_tests and ROOT is None:
        out["block_tests"] = {"rc": 0, "skipped": "tests/ is in kvstore's source checkout only"}
    elif not args.skip_tests:
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
