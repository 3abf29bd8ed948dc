#!/usr/bin/env python3
"""kvstore-server data planes and lookup latency, against limits measured in the same run.

    python benchmarks/server_bench.py [--quick] [--json PATH]

1. Same host, shared memory: ``Client.put`` (Reserve, copy into the arena,
   Commit) and ``Client.get_into`` (Acquire, copy out, Release) of 1-32 MiB
   chunks, against a single-thread memcpy of the same bytes (numpy copyto).
2. Remote streaming over loopback TCP: ``Client(shm=False).put/get`` against raw
   grpcio streaming of the same bytes in the same piece size, through a minimal
   sink/source service in another process (no kvstore code on either side).
3. Lookup: p50/p99 of one Lookup RPC for a 128k-token prompt whose 512 chunks
   are stored, among thousands of other chunks, against a raw grpcio unary echo
   of a request of the same size.

Every record is {name, value, unit, limit, ratio}: ratio = value / limit for
throughputs (1.0 = as fast as the limit) and latencies (1.0 = no overhead over
raw gRPC). The machine is shared and noisy: each figure is the median of
several runs, and the limit is re-measured next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
PIECE = 1 * MiB
RAW_SERVICE = "bench.Raw"


# -- the raw grpcio baseline: a sink, a source and an echo, with identity serializers -----

def raw_server(port: int) -> None:
    import grpc

    cache: dict[int, list[bytes]] = {}

    def sink(request_iterator: Iterator[bytes], context: Any) -> bytes:
        return str(sum(len(p) for p in request_iterator)).encode()

    def source(request: bytes, context: Any) -> Iterator[bytes]:
        size = int(request)
        if size not in cache:
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
            cache[size] = [data[o : o + PIECE] for o in range(0, size, PIECE)]
        yield from cache[size]

    def echo(request: bytes, context: Any) -> bytes:
        return request[:64]

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(source),
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
    })
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[
        ("grpc.max_receive_message_length", 8 * MiB), ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


# -- helpers --------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def record(name: str, value: float, unit: str, limit: float) -> dict[str, Any]:
    return {"name": name, "value": round(value, 4), "unit": unit, "limit": round(limit, 4),
            "ratio": round(value / limit, 4) if limit else None}


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    import kvstore

    deadline = time.monotonic() + timeout
    with kvstore.Client(url) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                sys.exit(f"kvstore-server exited: {out}")
            if c.health(timeout=1):
                return
            time.sleep(0.1)
    sys.exit("kvstore-server did not become ready")


# -- 1. shared memory vs memcpy ---------------------------------------------------------------

def bench_shm(url: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    import kvstore
    from kvstore.client import chunk_header
    from kvstore.keys import ROOT, Namespace

    out = []
    with kvstore.Client(url, shm=True, timeout=60) as c:
        assert c.shm_active, "shared memory is not usable from this process"
        for size in sizes:
            ns = Namespace(model="bench", dtype="bfloat16", layout=f"shm-{size}")
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            dst = np.empty_like(src)
            memcpy = median_time(lambda src=src, dst=dst: np.copyto(dst, src), reps * 3)
            headers = iter([chunk_header(ns, ROOT, np.arange(256) + 256 * i, src, "bfloat16",
                                         (256, size // 512)) for i in range(reps + 1)])
            keys: list[bytes] = []

            def put(c: Any = c, src: np.ndarray = src, headers: Any = headers,
                    keys: list[bytes] = keys) -> None:
                h = next(headers)
                assert c.put(h, src).ok
                keys.append(h.key)

            t_put = median_time(put, reps)
            t_get = median_time(lambda c=c, dst=dst, k=keys[-1]: c.get_into(k, dst), reps)
            assert np.array_equal(dst, src), "shm get returned other bytes"
            gbs = size / 1e9
            tag = f"{size // MiB}MiB"
            out.append(record(f"shm_put_{tag}", gbs / t_put, "GB/s", gbs / memcpy))
            out.append(record(f"shm_get_into_{tag}", gbs / t_get, "GB/s", gbs / memcpy))
            c.clear(ns)
    return out


# -- 2. remote streaming vs raw grpcio ---------------------------------------------------------------

def bench_stream(url: str, raw_port: int, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    import grpc

    import kvstore
    from kvstore.client import chunk_header
    from kvstore.keys import ROOT, Namespace

    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=opts)
    sink = channel.stream_unary(f"/{RAW_SERVICE}/Sink")
    source = channel.unary_stream(f"/{RAW_SERVICE}/Source")
    out = []
    with kvstore.Client(url, shm=False, timeout=60) as c:
        for size in sizes:
            ns = Namespace(model="bench", dtype="bfloat16", layout=f"grpc-{size}")
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            data = src.tobytes()
            pieces = [data[o : o + PIECE] for o in range(0, size, PIECE)]
            raw_put = median_time(lambda pieces=pieces: sink(iter(pieces), timeout=60), reps)
            raw_get = median_time(lambda size=size: b"".join(
                source(str(size).encode(), timeout=60)), reps)
            headers = iter([chunk_header(ns, ROOT, np.arange(256) + 256 * i, src, "bfloat16",
                                         (256, size // 512)) for i in range(reps + 1)])
            keys: list[bytes] = []

            def put(c: Any = c, src: np.ndarray = src, headers: Any = headers,
                    keys: list[bytes] = keys) -> None:
                h = next(headers)
                assert c.put(h, src).ok
                keys.append(h.key)

            t_put = median_time(put, reps)
            got: list[Any] = []
            t_get = median_time(lambda c=c, k=keys[-1], got=got: got.append(c.get(k)), reps)
            assert got[-1][1] == data, "streamed get returned other bytes"
            gbs = size / 1e9
            tag = f"{size // MiB}MiB"
            out.append(record(f"grpc_put_{tag}", gbs / t_put, "GB/s", gbs / raw_put))
            out.append(record(f"grpc_get_{tag}", gbs / t_get, "GB/s", gbs / raw_get))
            c.clear(ns)
    channel.close()
    return out


# -- 3. lookup latency -------------------------------------------------------------------------------

def bench_lookup(urls: dict[str, str], raw_port: int, n_tokens: int, extra_chunks: int,
                 reps: int) -> list[dict[str, Any]]:
    import grpc

    import kvstore
    from kvstore.client import chunk_header
    from kvstore.keys import ROOT, Namespace

    ns = Namespace(model="bench", dtype="bfloat16", layout="lookup")
    prompt = np.random.default_rng(1).integers(0, 150_000, n_tokens).astype(np.uint32)
    data = np.zeros(256 * 16, dtype=np.uint8)  # 16 bytes per token: lookup cost is not bytes
    with kvstore.Client(urls["tcp"], shm=False, timeout=60) as c:
        ct = c.info().chunk_tokens
        parent = ROOT
        for s in range(0, n_tokens, ct):
            part = prompt[s : s + ct]
            h = chunk_header(ns, parent, part, data[: len(part) * 16], "bfloat16",
                             (len(part), 8))
            assert c.put(h, data[: len(part) * 16]).ok
            parent = h.key
        other = Namespace(model="bench", dtype="bfloat16", layout="lookup-other")
        for i in range(extra_chunks):
            h = chunk_header(other, ROOT, np.arange(ct) + i * ct, data, "bfloat16", (ct, 8))
            c.put(h, data)
        chunks = c.stats().chunks

    token_bytes = prompt.astype("<u4").tobytes()
    channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}",
                                    options=[("grpc.max_send_message_length", -1)])
    echo = channel.unary_unary(f"/{RAW_SERVICE}/Echo")
    raw = []
    for _ in range(reps):
        t0 = time.perf_counter()
        echo(token_bytes, timeout=10)
        raw.append(time.perf_counter() - t0)
    channel.close()
    raw_p50 = float(np.percentile(raw, 50)) * 1e3
    raw_p99 = float(np.percentile(raw, 99)) * 1e3
    out = []
    for plane, url in urls.items():
        with kvstore.Client(url, timeout=10) as c:
            c.lookup(ns, prompt)
            lat = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r = c.lookup(ns, prompt)
                lat.append(time.perf_counter() - t0)
            assert r.matched_tokens == n_tokens, r
        p50, p99 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 99))
        tag = f"{n_tokens // 1024}k_tokens_{chunks}_chunks_{plane}"
        out.append(record(f"lookup_p50_{tag}", p50, "ms", raw_p50))
        out.append(record(f"lookup_p99_{tag}", p99, "ms", raw_p99))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "server_bench.json"),
                   help="where to write the JSON records")
    args = p.parse_args()
    if args.raw_server:
        raw_server(args.raw_server)
        return 0

    sizes = [1 * MiB, 32 * MiB] if args.quick else [1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB]
    reps = 5 if args.quick else 9
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    port, raw_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # No L2: a write-through to LMDB would compete for this machine's two cores.
    server = start([sys.executable, "-m", "kvstore.server.main", "--listen",
                    f"127.0.0.1:{port}", "--unix-socket", str(tmp / "kv.sock"), "--data-dir",
                    str(tmp / "data"), "--memory-capacity", "512MiB", "--no-disk",
                    "--log-level", "warning"], env)
    raw = start([sys.executable, __file__, "--raw-server", str(raw_port)], env)
    records: list[dict[str, Any]] = []
    try:
        assert raw.stdout is not None and raw.stdout.readline().strip() == b"ready"
        urls = {"unix": f"unix://{tmp / 'kv.sock'}", "tcp": f"grpc://127.0.0.1:{port}"}
        wait_health(urls["unix"], server)
        records += bench_shm(urls["unix"], sizes, reps)
        records += bench_stream(urls["tcp"], raw_port, sizes, reps)
        records += bench_lookup(urls, raw_port, 128 * 1024, 1000 if args.quick else 4000,
                                50 if args.quick else 200)
    finally:
        for proc in (server, raw):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"{'name':44s} {'value':>10s} {'limit':>10s} {'unit':5s} {'ratio':>6s}")
    for r in records:
        print(f"{r['name']:44s} {r['value']:10.3f} {r['limit']:10.3f} {r['unit']:5s} "
              f"{r['ratio']:6.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
