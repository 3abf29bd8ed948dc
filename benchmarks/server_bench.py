"""kvstore-server benchmarks: both data planes and lookup latency, each against a limit.

    python -m benchmarks.server_bench [--quick] [--json PATH] [--markdown PATH]

Also a suite of ``python -m benchmarks`` (``run(quick, progress)``). A real
kvstore-server runs in a subprocess (L1 only: an LMDB write-through would compete
for the CPU with what is measured), the clients in this process.

1. Same host, shared memory: ``Client.put`` (Reserve, copy into the arena,
   Commit, which checks the header and publishes) and ``Client.get_into`` (Acquire, which
   verifies them, copy out, Release) of 64 KiB-64 MiB chunks (quick: 64 KiB,
   1 and 32 MiB), against a single-thread memcpy of the same bytes into a
   touched buffer; and, up to 4 MiB, puts of 16 chunks at once (``Client.put_many``:
   4 parts pipelined, each chunk hashed as it is copied in, 8 calls a batch; and the
   same with ``Client.reserve``, the writes, ``Client.commit``: 2 calls, not pipelined).
2. Remote streaming over loopback TCP: ``Client(shm=False).put/get`` against raw
   grpcio streaming of the same bytes in the same 1 MiB pieces, to and from a
   minimal sink/source service in another process (no kvstore code on its path);
   and that raw grpcio streaming against plain Python sockets moving the same
   bytes over loopback TCP (``server.grpc_raw.*``: what gRPC itself costs).
3. Lookup: p50/p99 of one Lookup RPC for a 128k-token prompt whose 512 chunks
   are stored among thousands of others, sent by its chunk keys and sub-hashes (the
   SDK's default, 80 KiB) and by its token ids (512 KiB), each against a raw grpcio
   unary call carrying the same request bytes; and the parts of the keys lookup
   that run in the client, against an empty raw unary call.

Cases and their limits take turns (``harness.interleaved``), so noise from other
tenants of this shared machine hits both alike; compare ratios, not values.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.testing.ports import free_port

from .harness import (
    GB,
    Case,
    KiB,
    LoopbackTcp,
    MiB,
    Progress,
    Record,
    child_cwd,
    interleaved,
    machine_info,
    make_progress,
    markdown,
    median,
    memcpy,
    module,
    output_dir,
    percentile,
    random_bytes,
    size_label,
    touched,
    write_json,
)

PIECE = 1 * MiB  # the server's default piece_bytes
RAW = "bench.Raw"
MEMCPY = "memcpy (1 thread, touched dst)"
RAW_STREAM = "raw grpcio stream, 1 MiB pieces"
RAW_UNARY = "raw grpcio unary call, same request bytes"
LOOPBACK = "loopback TCP (Python sockets, another process)"


# -- the raw grpcio limit: sink, source and echo with identity serializers -----------------
def raw_server(port: int) -> None:
    import grpc

    cache: dict[int, list[bytes]] = {}

    def sink(request_iterator: Iterator[bytes], context: Any) -> bytes:
        return str(sum(len(p) for p in request_iterator)).encode()

    def source(request: bytes, context: Any) -> Iterator[bytes]:
        size = int(request)
        if size not in cache:
            data = random_bytes(size, size).tobytes()
            cache[size] = [data[o : o + PIECE] for o in range(0, size, PIECE)]
        yield from cache[size]

    def echo(request: bytes, context: Any) -> bytes:
        return request[:64]

    handler = grpc.method_handlers_generic_handler(
        RAW,
        {
            "Sink": grpc.stream_unary_rpc_method_handler(sink),
            "Source": grpc.unary_stream_rpc_method_handler(source),
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(8),
        options=[("grpc.max_receive_message_length", 8 * MiB), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


# -- processes ------------------------------------------------------------------------------
class Servers:
    """kvstore-server (Unix socket + TCP) and the raw grpcio service, as subprocesses."""

    def __init__(self, memory: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
        self.port, self.raw_port = free_port(), free_port()
        self.unix = f"unix://{self.tmp / 'kv.sock'}"
        self.tcp = f"grpc://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.server.main",
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    "--unix-socket",
                    str(self.tmp / "kv.sock"),
                    "--data-dir",
                    str(self.tmp / "data"),
                    "--memory-capacity",
                    memory,
                    "--no-disk",
                    "--log-level",
                    "warning",
                ],
                env=env,
                cwd=child_cwd(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            ),
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module("server_bench"),
                    "--raw-server",
                    str(self.raw_port),
                ],
                env=env,
                cwd=child_cwd(),
                stdout=subprocess.PIPE,
            ),
        ]

    def __enter__(self) -> Servers:
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()  # no server outlives a failed start
            raise
        return self

    def _wait_ready(self) -> None:
        import kvstore

        raw = self.procs[1]
        if raw.stdout is None or raw.stdout.readline().strip() != b"ready":
            raise RuntimeError("the raw grpcio server did not start")
        deadline = time.monotonic() + 60
        with kvstore.Client(self.unix) as c:
            while not c.health(timeout=1):
                if self.procs[0].poll() is not None or time.monotonic() > deadline:
                    self.procs[0].kill()  # so that reading its output cannot block
                    out = self.procs[0].stdout.read() if self.procs[0].stdout else b""
                    raise RuntimeError(f"kvstore-server did not start: {out.decode()[-2000:]}")
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def raw_channel(self) -> Any:
        import grpc

        return grpc.insecure_channel(
            f"127.0.0.1:{self.raw_port}",
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
        )


def _headers(tag: str, src: np.ndarray, n: int) -> list[Any]:
    from kvstore.keys import ROOT, Namespace
    from kvstore.sdk.client import chunk_header

    ns = Namespace(model="bench", dtype="bfloat16", layout=f"{tag}-{src.size}")
    return [
        chunk_header(ns, ROOT, np.arange(256) + 256 * i, src, "bfloat16", (256, src.size // 512))
        for i in range(n)
    ]


def _gbs(nbytes: int, seconds: list[float]) -> float:
    return nbytes / GB / median(seconds)


# -- 1. shared memory vs memcpy ---------------------------------------------------------------
def bench_shm(s: Servers, sizes: list[int], reps: int, progress: Progress) -> list[Record]:
    import kvstore
    from kvstore.sdk.shm import LeaseBase
    from kvstore.types import PutStatus

    out = []
    with (
        kvstore.Client(s.unix, shm=True, timeout=60) as c,
        kvstore.Client(s.unix, shm=True, timeout=60) as g,
    ):
        g.use_express = False  # the same batches with their calls over gRPC
        if not (c.shm_active and g.shm_active):
            raise RuntimeError("shared memory is not usable from this process")
        if c.express is None:
            raise RuntimeError("the server offers no express plane")
        time.sleep(1.0)  # let the client's background prefault of the arena finish
        for size in sizes:
            src, dst = random_bytes(size, size), touched(size)
            put_h, get_h = _headers("shm", src, 2)
            assert c.put(get_h, src).ok

            def put(h: Any = put_h, src: np.ndarray = src) -> None:
                assert c.put(h, src).ok

            def undo(h: Any = put_h) -> None:
                c.delete([h.key])

            def get_into(k: bytes = get_h.key, dst: np.ndarray = dst) -> None:
                c.get_into(k, dst)

            cases: dict[str, Case] = {
                "memcpy": memcpy(src, dst),
                "put": (put, undo),
                "get_into": get_into,
            }
            batch = _unsealed("shm-batch", src, BATCH) if size <= 4 * MiB else []
            if batch:

                def put_batch(hs: list[Any] = batch, src: np.ndarray = src, c: Any = c) -> None:
                    # Pipelined over the express plane (PIPE_PARTS parts), one part by gRPC.
                    got = c.put_many(hs, [src] * len(hs), checksum_at_commit=True)
                    assert all(st == PutStatus.STORED for st in got)

                def put_reserved(hs: list[Any] = batch, src: np.ndarray = src) -> None:
                    held = c.reserve(hs)
                    for res in held:
                        res.write(src)
                    assert all(st == PutStatus.STORED for st in c.commit(held))

                def undo_batch(hs: list[Any] = batch) -> None:
                    c.delete([h.key for h in hs])

                cases["put_batch"] = (put_batch, undo_batch)
                cases["put_batch.grpc"] = (functools.partial(put_batch, c=g), undo_batch)
                cases["put_batch_reserved"] = (put_reserved, undo_batch)
                stored = _unsealed("shm-gets", src, BATCH)
                held = c.reserve(stored)
                for res in held:
                    res.write(src)  # type: ignore[union-attr]
                assert all(st == PutStatus.STORED for st in c.commit(held))  # type: ignore[arg-type]
                many = touched(BATCH * size)
                outs = [many[i * size : (i + 1) * size] for i in range(BATCH)]

                def get_batch(
                    keys: tuple[bytes, ...] = tuple(h.key for h in stored),
                    outs: list[np.ndarray] = outs,
                    c: Any = c,
                ) -> None:
                    # A connector step's loads: one AcquireMany, one verified copy a
                    # chunk straight into the destination, one Release not waited for.
                    leases = c.acquire_many(keys)
                    for lease, out in zip(leases, outs, strict=True):
                        assert isinstance(lease, LeaseBase) and lease.read_verified(out)
                    c.release_later(leases)

                cases["get_batch"] = get_batch
                cases["get_batch.grpc"] = functools.partial(get_batch, c=g)
                # The batches' limit: one memcpy of the batch's bytes (a 1 MiB memcpy runs
                # from the CPU's caches, faster than 16 MiB moved through memory).
                cases["memcpy_batch"] = memcpy(random_bytes(BATCH * size, BATCH * size), many)
            t = interleaved(cases, reps, progress, f"shm {size_label(size)}")
            if not np.array_equal(dst, src):
                raise RuntimeError("shared-memory get_into delivered other bytes")
            limit = _gbs(size, t["memcpy"])
            for case in ("put", "get_into"):
                out.append(
                    Record(
                        f"server.shm.{case}.{size_label(size)}",
                        _gbs(size, t[case]),
                        "GB/s",
                        limit,
                        limit_name=MEMCPY,
                        notes="Unix socket; 2 RPCs per put, 1 per get",
                    )
                )
            if batch:
                limit = _gbs(BATCH * size, t["memcpy_batch"])
                what = {
                    "put_batch": ("4 ReserveMany + 4 CommitMany, pipelined", "each hashed "
                                  "while copied in (Client.put_many)"),
                    "get_batch": ("AcquireMany", "each verified while copied out, one "
                                  "Release not waited for (Client.acquire_many / "
                                  "release_later)"),
                }  # fmt: skip
                for plane, how in (("", "express plane"), (".grpc", "gRPC")):
                    for case, (calls, copies) in what.items():
                        if plane and case == "put_batch":
                            calls = "ReserveMany + CommitMany (one part over gRPC)"
                        out.append(
                            Record(
                                f"server.shm.{case}{plane}.{size_label(size)}",
                                _gbs(BATCH * size, t[f"{case}{plane}"]),
                                "GB/s",
                                limit,
                                limit_name=MEMCPY,
                                target="0.5 of memcpy at 1 MiB" if not plane else "",
                                notes=f"{BATCH} chunks per {calls} ({how}), {copies}",
                            )
                        )
                out.append(
                    Record(
                        f"server.shm.put_batch_reserved.{size_label(size)}",
                        _gbs(BATCH * size, t["put_batch_reserved"]),
                        "GB/s",
                        limit,
                        limit_name=MEMCPY,
                        notes=f"{BATCH} chunks per ReserveMany + CommitMany, not pipelined "
                        "(Client.reserve, write, Client.commit: what put_batch did before "
                        "put_many)",
                    )
                )
                c.delete([h.key for h in stored])
            c.delete([get_h.key])
    return out


BATCH = 16  # chunks per batched put


def _unsealed(tag: str, src: np.ndarray, n: int) -> list[Any]:
    from kvstore.keys import ROOT, Namespace
    from kvstore.sdk.client import chunk_header

    ns = Namespace(model="bench", dtype="bfloat16", layout=f"{tag}-{src.size}")
    return [
        chunk_header(ns, ROOT, np.arange(256) + 256 * i, None, "bfloat16", (256, src.size // 512))
        for i in range(n)
    ]


# -- 2. remote streaming vs raw grpcio ---------------------------------------------------------
def bench_stream(
    s: Servers, tcp: LoopbackTcp, sizes: list[int], reps: int, progress: Progress
) -> list[Record]:
    import kvstore

    channel = s.raw_channel()
    sink = channel.stream_unary(f"/{RAW}/Sink")
    source = channel.unary_stream(f"/{RAW}/Source")
    out = []
    with kvstore.Client(s.tcp, shm=False, timeout=60) as c:
        for size in sizes:
            src = random_bytes(size, size)
            data = src.tobytes()
            pieces = [data[o : o + PIECE] for o in range(0, size, PIECE)]
            put_h, get_h = _headers("grpc", src, 2)
            assert c.put(get_h, src).ok
            got: list[Any] = []

            def put(h: Any = put_h, src: np.ndarray = src) -> None:
                assert c.put(h, src).ok

            def undo(h: Any = put_h) -> None:
                c.delete([h.key])

            def get(k: bytes = get_h.key, got: list[Any] = got) -> None:
                got.append(c.get(k))

            def raw_put(p: list[bytes] = pieces) -> None:
                sink(iter(p), timeout=60)

            def raw_get(n: int = size) -> None:
                b"".join(source(str(n).encode(), timeout=60))

            dst = touched(size)
            cases: dict[str, Case] = {
                "raw_put": raw_put,
                "raw_get": raw_get,
                "put": (put, undo),
                "get": get,
                "tcp_put": functools.partial(tcp.put, src),
                "tcp_get": functools.partial(tcp.get_into, dst),
            }
            t = interleaved(cases, reps, progress, f"grpc {size_label(size)}")
            if got[-1] is None or got[-1][1] != data:
                raise RuntimeError("streamed get delivered other bytes")
            got.clear()
            for case in ("put", "get"):
                limit = _gbs(size, t[f"raw_{case}"])
                out.append(
                    Record(
                        f"server.grpc.{case}.{size_label(size)}",
                        _gbs(size, t[case]),
                        "GB/s",
                        limit,
                        limit_name=RAW_STREAM,
                        notes="loopback TCP",
                    )
                )
            for case in ("put", "get"):
                out.append(
                    Record(
                        f"server.grpc_raw.{case}.{size_label(size)}",
                        _gbs(size, t[f"raw_{case}"]),
                        "GB/s",
                        _gbs(size, t[f"tcp_{case}"]),
                        limit_name=LOOPBACK,
                        notes="what grpcio itself costs: raw streaming vs plain "
                        "sockets moving the same bytes",
                    )
                )
            c.delete([get_h.key])
    channel.close()
    return out


# -- 3. lookup latency -------------------------------------------------------------------------
def bench_lookup(
    s: Servers, n_tokens: int, others: int, reps: int, progress: Progress
) -> list[Record]:
    """Lookup of a 128k-token prompt sent both ways: by its chunk keys and sub-hashes (the
    SDK's default: ``server.lookup_keys.*``) and by its token ids (``server.lookup.*``,
    what older clients send), each against a raw grpcio unary call carrying the same
    request bytes; and where the keys lookup spends its time (``server.lookup_keys.parts``:
    the client's hashing, the request's and the answer's protobuf work, the server's walk
    over an index like the server's). Also a miss (``server.lookup_keys.miss``): a
    1,024-token prompt none of whose chunks is stored, among ``others`` stored first
    chunks of its namespace (each a sibling its first chunk could partly match), asked of
    the server; and the same miss as the SDK answers it by default, from the server's
    presence filter with no call (``server.lookup_keys.miss_filtered``)."""
    import kvstore
    from kvstore.keys import ROOT, Namespace, chunk_keys, token_view
    from kvstore.protocol import lookup_from_pb
    from kvstore.sdk.chunks import lookup_hashes
    from kvstore.sdk.client import chunk_header
    from kvstore.v1 import kvstore_pb2 as pb

    ns = Namespace(model="bench", dtype="bfloat16", layout="lookup")
    prompt = np.random.default_rng(1).integers(0, 150_000, n_tokens).astype(np.uint32)
    data = np.zeros(256 * 16, dtype=np.uint8)  # 16 bytes per token: lookup never reads bytes
    with kvstore.Client(s.unix, timeout=60) as c:
        info = c.info()
        ct, g = info.chunk_tokens, info.granularity
        for i in progress(range(others), desc="lookup: filling the store", total=others):
            c.put(chunk_header(ns, ROOT, np.arange(ct) + i * ct, data, "bfloat16", (ct, 8)), data)
        parent = ROOT
        for start in range(0, n_tokens, ct):
            part = prompt[start : start + ct]
            h = chunk_header(ns, parent, part, data[: len(part) * 16], "bfloat16", (len(part), 8))
            assert c.put(h, data[: len(part) * 16]).ok
            parent = h.key
        chunks = c.stats().chunks
        tv = token_view(prompt)
        key_request = c._lookup_request(ns, tv, 0, 0, False)  # what the SDK sends

    token_bytes = prompt.astype("<u4").tobytes()
    key_bytes = key_request.SerializeToString()
    id_bytes = pb.LookupRequest(
        fingerprint=ns.fingerprint, token_ids=token_bytes
    ).SerializeToString()
    channel = s.raw_channel()
    echo = channel.unary_unary(f"/{RAW}/Echo")
    # "express": the blocking client's own choice over the Unix socket (the express
    # plane); "unix" and "tcp": gRPC, over the Unix socket and over TCP.
    clients, by_ids = {}, {}
    for plane, url in (("express", s.unix), ("unix", s.unix), ("tcp", s.tcp)):
        clients[plane], by_ids[plane] = kvstore.Client(url), kvstore.Client(url)
        by_ids[plane].lookup_by_keys = False
        for client in (clients[plane], by_ids[plane]):
            client.use_express = plane == "express"
    asks = kvstore.Client(s.unix)  # the server's own answer to a miss: the filter unread
    asks.use_presence = False
    matched: list[int] = []
    answer = None
    try:

        def look(c: kvstore.Client) -> None:
            matched.append(c.lookup(ns, prompt).matched_tokens)

        miss = np.random.default_rng(2).integers(150_000, 160_000, 1024).astype(np.uint32)
        missed: list[int] = []

        def look_miss(c: kvstore.Client) -> None:
            missed.append(c.lookup(ns, miss).matched_tokens)

        filtered = clients["express"]._presence  # the client's answers from the filter

        def keep_answer() -> None:
            nonlocal answer
            answer = clients["unix"]._stub.Lookup(key_request, metadata=clients["unix"]._metadata)

        keep_answer()
        assert answer is not None
        answer_bytes = answer.SerializeToString()
        cases: dict[str, Case] = {
            "raw.ids": lambda: echo(id_bytes, timeout=10),
            "raw.keys": lambda: echo(key_bytes, timeout=10),
            "raw.empty": lambda: echo(b"", timeout=10),
            # The parts of a lookup by keys, each alone in this process.
            "part.keys": lambda: chunk_keys(ns.fingerprint, prompt, ct),
            "part.sub_hashes": lambda: lookup_hashes(ns.fingerprint, tv, ct, g),
            "part.request": lambda: (
                clients["unix"]._lookup_request(ns, tv, 0, 0, False).SerializeToString()
            ),
            "part.answer": lambda: lookup_from_pb(pb.LookupResponse.FromString(answer_bytes)),
        }
        for plane in clients:
            cases[f"keys.{plane}"] = functools.partial(look, clients[plane])
            cases[f"ids.{plane}"] = functools.partial(look, by_ids[plane])
        cases["miss.express"] = functools.partial(look_miss, asks)
        cases["miss.filtered"] = functools.partial(look_miss, clients["express"])
        t = interleaved(cases, reps, progress, "lookup 128k", warmup=3)
        if not filtered.answered:
            raise RuntimeError("the miss was never answered by the presence filter")
    finally:
        for c in (*clients.values(), *by_ids.values(), asks):
            c.close()
        channel.close()
    if set(matched) != {n_tokens} or set(missed) != {0}:
        raise RuntimeError(
            f"lookup matched {set(matched)} tokens, expected {n_tokens}; the miss {set(missed)}"
        )
    out = []
    label = f"{n_tokens // 1024}k"
    notes = f"{n_tokens // ct} chunks matched of {chunks} stored"
    for q in (50, 99):
        for plane in clients:
            for feed, name, size in (
                ("ids", "lookup", len(id_bytes)),
                ("keys", "lookup_keys", len(key_bytes)),
            ):
                limit = percentile(t[f"raw.{feed}"], q) * 1e3
                out.append(
                    Record(
                        f"server.{name}.{label}.p{q}.{plane}",
                        percentile(t[f"{feed}.{plane}"], q) * 1e3,
                        "ms",
                        limit,
                        limit_name=f"{RAW_UNARY} ({size // KiB} KiB)",
                        target="p99 < 2 ms" if feed == "keys" else "",
                        notes=notes,
                    )
                )
        floor = percentile(t["raw.empty"], q) * 1e3
        for name, case, why in (
            (
                f"miss.p{q}.express",
                "miss.express",
                f"a 1,024-token prompt none of whose chunks is stored, among {others} "
                "stored first chunks of its namespace (asked of the server)",
            ),
            (
                f"miss_filtered.p{q}",
                "miss.filtered",
                "the same miss answered by the client from the server's presence filter "
                "(kvstore.presence), no call",
            ),
        ):
            out.append(
                Record(
                    f"server.lookup_keys.{name}",
                    percentile(t[case], q) * 1e3,
                    "ms",
                    floor,
                    limit_name="raw grpcio unary call, empty request",
                    notes=why,
                )
            )
        for step, what in (
            ("keys", "client: the prompt's chunk keys (keys.chunk_keys)"),
            ("sub_hashes", "client: the keys and every chunk's sub-hashes (not sent for 128k)"),
            ("request", "client: the request the SDK sends built and serialized (keys)"),
            ("answer", "client: the 512-chunk answer parsed into a LookupResult"),
        ):
            out.append(
                Record(
                    f"server.lookup_keys.{label}.parts.{step}.p{q}",
                    percentile(t[f"part.{step}"], q) * 1e3,
                    "ms",
                    floor,
                    limit_name="raw grpcio unary call, empty request",
                    notes=what,
                )
            )
    return out


def run(quick: bool, progress: Progress) -> list[Record]:
    if quick:
        sizes = [64 * KiB, 1 * MiB, 32 * MiB]
    else:
        sizes = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB, 64 * MiB]
    reps = 5 if quick else 15
    # A record takes at least one 64 KiB page.
    with Servers("512MiB") as s, LoopbackTcp() as tcp:
        records = bench_shm(s, sizes, reps, progress)
        records += bench_stream(s, tcp, sizes, reps, progress)
        # A p99 of 1,000 calls is the 10th slowest: of 200 it was nearly the slowest one,
        # one burst of the host's noise.
        records += bench_lookup(
            s, 128 * 1024, 1000 if quick else 5000, 40 if quick else 1000, progress
        )
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument(
        "--json",
        metavar="FILE",
        default=str(output_dir() / "results" / "server_bench.json"),
        help="write the records as a JSON list (default: %(default)s)",
    )
    ap.add_argument("--markdown", metavar="FILE", help="also write a Markdown table")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if args.raw_server:
        raw_server(args.raw_server)
        return 0
    records = run(args.quick, make_progress(not args.no_progress))
    for r in records:
        r.suite = "server"
    mode = "quick" if args.quick else "full"
    text = markdown(records, machine_info(), f"kvstore-server benchmarks ({mode})")
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(records, args.json)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
