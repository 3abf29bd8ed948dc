"""Scale-out: kvstore-servers sharing one 3-node Valkey cluster as L3 (issue 14).

    python -m benchmarks.scale_out [--quick] [--json out.json]

Four kvstore-servers, each with its own data dir and arena as separate hosts would run
them, on one Valkey cluster (``ServerCluster(3)``): a writer stores sets of chunks
(raw codec, so L3 holds the bytes as they are) and waits until they are in L3; three
readers then fetch them (``Client.get_into`` over each server's own shared memory, so
every read is an L3 hit promoted into that reader's L1):

- ``scale.read.one`` / ``scale.read.three``: one reader fetching a whole set against
  the three fetching a set of the same size together, a third each, at once, in turns
  with fresh sets (a set once read sits in its reader's L1). The ratio of the two is what
  the two other servers add; all of it runs on this machine's 2 cores, servers, cluster
  and clients alike, where three hosts would bring their own;
- ``scale.node_down.*``: one cluster node stopped; a reader fetches a set stored before:
  the share of hits (the chunks on the other two nodes, fewer once the tier's circuit
  breaker opens) and read latency p50 / p99, each against the same figure with every
  node up;
- ``scale.node_back.*``: the node restarted (empty: the cluster runs without
  persistence) and a fresh set stored: its hit rate, and how long the first read after
  the restart took.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.keys import ROOT, ChunkKey, Namespace
from kvstore.types import PutStatus

from .harness import (
    GB,
    MiB,
    Progress,
    Record,
    machine_info,
    make_progress,
    markdown,
    module,
    percentile,
    write_json,
)

NS = Namespace("bench/scale-out", dtype="float16")
CHUNK = 256  # tokens: the servers' default chunk_tokens
ENV = {
    "KVSTORE_REMOTE_CODEC": "raw",
    "KVSTORE_REMOTE_TIMEOUT_MS": "2000",
    "KVSTORE_REMOTE_CONNECT_TIMEOUT_MS": "500",
    "KVSTORE_REMOTE_COOLDOWN_MS": "1000",
}


@dataclass(frozen=True)
class Params:
    chunk_bytes: int
    chunks: int  # per set
    reps: int

    @classmethod
    def make(cls, quick: bool) -> Params:
        return cls(1 * MiB, 12, 2) if quick else cls(2 * MiB, 24, 4)


@dataclass
class ChunkSet:
    tokens: np.ndarray
    keys: list[ChunkKey]
    blocks: list[np.ndarray]


def make_set(client: object, p: Params, seed: int) -> ChunkSet:
    """One prompt of ``p.chunks`` chunks stored through ``client`` (the writer)."""
    rng = np.random.default_rng(seed)
    width = p.chunk_bytes // (2 * CHUNK)
    tokens = rng.integers(0, 50_000, p.chunks * CHUNK)
    keys: list[ChunkKey] = []
    blocks: list[np.ndarray] = []
    parent = ROOT
    for i in range(p.chunks):
        block = rng.standard_normal((CHUNK, width)).astype(np.float16)
        parent, status = client.put_chunk(  # type: ignore[attr-defined]
            NS, parent, tokens[i * CHUNK : (i + 1) * CHUNK], block, "float16", block.shape
        )
        if status is not PutStatus.STORED:
            raise RuntimeError(f"the writer refused chunk {i}: {status}")
        keys.append(parent)
        blocks.append(block)
    return ChunkSet(tokens, keys, blocks)


def wait_in_l3(client: object, s: ChunkSet, timeout: float = 60.0) -> None:
    """Until a reader that never saw the set finds all of it (the write-through is async)."""
    deadline = time.monotonic() + timeout
    while client.lookup(NS, s.tokens).matched_tokens < len(s.tokens):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("the writer's chunks did not reach L3 in time")
        time.sleep(0.05)


def read(client: object, s: ChunkSet, idx: Sequence[int], lat: list[float]) -> int:
    """get_into of the chunks ``idx`` of ``s``; hits (each checked byte for byte)."""
    hits = 0
    out = np.empty_like(s.blocks[0])
    for i in idx:
        t0 = time.perf_counter()
        got = client.get_into(s.keys[i], out)  # type: ignore[attr-defined]
        lat.append(time.perf_counter() - t0)
        if got is not None:
            if not np.array_equal(out, s.blocks[i]):
                raise RuntimeError("a reader got other bytes than were stored")
            hits += 1
    return hits


def read_three(readers: Sequence[object], s: ChunkSet, lat: list[float]) -> float:
    """The three readers fetch a third of ``s`` each, at once; seconds for all."""
    n = len(s.keys)
    parts = [list(range(i, n, len(readers))) for i in range(len(readers))]
    errors: list[BaseException] = []
    lats: list[list[float]] = [[] for _ in readers]

    def work(j: int) -> None:
        try:
            if read(readers[j], s, parts[j], lats[j]) != len(parts[j]):
                raise RuntimeError("a reader missed a chunk that is in L3")
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(readers))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    for x in lats:
        lat += x
    return dt


def run(quick: bool, progress: Progress) -> list[Record]:
    import kvstore
    from kvstore.testing.redis import ServerCluster, available
    from kvstore.testing.server import KVServer

    if not available("valkey"):
        raise RuntimeError("valkey-server is not installed")
    p = Params.make(quick)
    nbytes = p.chunks * p.chunk_bytes
    root = Path(tempfile.mkdtemp(prefix="kvstore-scale-"))
    arena = f"{max(64, 2 * nbytes * (p.reps + 3) // MiB)}MiB"
    with ServerCluster(3, "valkey") as cluster:
        servers = [
            KVServer(root / n, n, args=["--remote", cluster.url], env=ENV, memory=arena)
            for n in ("writer", "reader0", "reader1", "reader2")
        ]
        try:
            for s in servers:
                s.start()
            clients = [kvstore.Client(s.unix_url) for s in servers]
            writer, readers = clients[0], clients[1:]
            seed = iter(range(1000))
            one_t: list[float] = []
            three_t: list[float] = []
            one_lat: list[float] = []
            three_lat: list[float] = []
            for _ in progress(range(p.reps), desc="scale-out: one vs three readers"):
                a, b = make_set(writer, p, next(seed)), make_set(writer, p, next(seed))
                wait_in_l3(writer, a)
                wait_in_l3(readers[2], b)  # a lookup does not promote: b stays in L3 only
                t0 = time.perf_counter()
                if read(readers[0], a, range(p.chunks), one_lat) != p.chunks:
                    raise RuntimeError("the reader missed a chunk that is in L3")
                one_t.append(time.perf_counter() - t0)
                three_t.append(read_three(readers, b, three_lat))
            out = _read_records(p, nbytes, one_t, three_t, one_lat, three_lat)
            out += _node_down(p, cluster, writer, readers, seed)
        finally:
            for c in locals().get("clients", []):
                c.close()
            for s in servers:
                if s.proc is not None and s.proc.poll() is None:
                    s.stop()
    return out


def _read_records(
    p: Params,
    nbytes: int,
    one_t: list[float],
    three_t: list[float],
    one_lat: list[float],
    three_lat: list[float],
) -> list[Record]:
    one = nbytes / float(np.median(one_t)) / GB
    three = nbytes / float(np.median(three_t)) / GB
    size = f"{p.chunks} chunks of {p.chunk_bytes // MiB} MiB"
    return [
        Record("scale.read.one", one, "GB/s", notes=f"one reader, {size}, all L3 hits"),
        Record("scale.read.three", three, "GB/s", one, limit_name="one reader (scale.read.one)",
               notes=f"three readers at once, a third of {size} each: aggregate"),
        Record("scale.read.p50_ms.three", percentile(three_lat, 50) * 1e3, "ms",
               percentile(one_lat, 50) * 1e3, limit_name="one reader's p50",
               notes="get_into of one chunk, L3 hit promoted into the reader's L1"),
    ]  # fmt: skip


def _node_down(
    p: Params, cluster: object, writer: object, readers: Sequence[object], seed: object
) -> list[Record]:
    up_lat: list[float] = []
    base = make_set(writer, p, next(seed))  # type: ignore[call-overload]
    gone = make_set(writer, p, next(seed))  # type: ignore[call-overload]
    wait_in_l3(writer, base)
    wait_in_l3(writer, gone)
    up_hits = read(readers[0], base, range(p.chunks), up_lat)
    cluster.stop_node(1)  # type: ignore[attr-defined]
    down_lat: list[float] = []
    down_hits = read(readers[1], gone, range(p.chunks), down_lat)
    cluster.start_node(1)  # type: ignore[attr-defined]
    cluster.wait_ok()  # type: ignore[attr-defined]
    back = make_set(writer, p, next(seed))  # type: ignore[call-overload]
    t0 = time.monotonic()
    wait_in_l3(readers[2], back)
    back_s = time.monotonic() - t0
    back_lat: list[float] = []
    back_hits = read(readers[2], back, range(p.chunks), back_lat)
    up_rate = up_hits / p.chunks
    return [
        Record("scale.node_down.hit_rate", down_hits / p.chunks, "fraction", up_rate,
               limit_name="hit rate with every node up",
               notes="1 of 3 cluster nodes stopped; a set stored before, read by another server"),
        Record("scale.node_down.p50_ms", percentile(down_lat, 50) * 1e3, "ms",
               percentile(up_lat, 50) * 1e3, limit_name="p50 with every node up"),
        Record("scale.node_down.p99_ms", percentile(down_lat, 99) * 1e3, "ms",
               percentile(up_lat, 99) * 1e3, limit_name="p99 with every node up"),
        Record("scale.node_back.hit_rate", back_hits / p.chunks, "fraction", up_rate,
               limit_name="hit rate with every node up",
               notes="node restarted empty; a set stored after it came back"),
        Record("scale.node_back.shared_s", back_s, "s",
               notes="from storing the set after the restart until another server sees all of it"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {module('scale_out')}", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="12 chunks of 1 MiB, 2 repetitions")
    ap.add_argument("--json", metavar="FILE", help="write the records as JSON")
    args = ap.parse_args(argv)
    records = run(args.quick, make_progress(sys.stderr.isatty()))
    for r in records:
        r.suite = "scale_out"
    if args.json:
        write_json(records, args.json)
    print(markdown(records, machine_info(), "scale-out"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
