"""Aggregate throughput of 1-16 concurrent clients of one kvstore-server.

One kvstore-server (L1 only, shared-memory data plane) and up to 16 client
*processes* (processes, not threads: threads of one Python process share one
GIL and would measure it, not the server). Each client has its own
``kvstore.Client`` on the Unix socket and, per round, does ``OPS`` operations of
one kind on 4 MiB chunks:

- ``put``: ``Client.put`` of ``OPS`` fresh chunks (Reserve, copy into the arena,
  Commit: the server checks the header and publishes); deleted again, untimed, after the round;
- ``get``: ``Client.get_into`` of the client's own stored chunk (Acquire: the server
  verifies it; copy out; Release);
- ``save``: an engine step's save: ``Client.reserve`` of 16 fresh 1 MiB chunks (one
  ReserveMany), each written into its pages hashed as it is copied, one
  ``Client.commit`` (CommitMany: the server checks every payload against its
  checksum); the same bytes per round as ``put``, deleted again, untimed;
- ``memcpy``, the limit: numpy copies of the same 4 MiB into a touched buffer, by
  the same processes at the same time, i.e. what this machine's cores and memory
  can copy with that much parallelism (on 2 cores it stops growing at 2 clients).

The clients of a round start together (a start time on the shared monotonic
clock); a round's figure is its bytes over the time from the first client's start
to the last client's end. The kinds take turns in a shuffled order within every
repetition, and the median over repetitions is reported. The saves are measured
again against a server writing every chunk through to LMDB, as it does by default
(``save_l2``: its write-down runs beside the commits).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstore.testing.server import KVServer

from .harness import (
    GB,
    MiB,
    Progress,
    Record,
    ServerProcess,
    median,
    random_bytes,
    touched,
)

CHUNK = 4 * MiB
OPS = 4  # operations per client per round
SAVE_CHUNK, SAVE_BATCH = 1 * MiB, 16  # a step's save: 16 chunks of 1 MiB, 16 MiB
KINDS = ("memcpy", "put", "get", "save")
START_DELAY_S = 0.05
LIMIT = "memcpy by as many processes in parallel (aggregate)"


@dataclass(frozen=True)
class Params:
    clients: tuple[int, ...]
    reps: int

    @classmethod
    def make(cls, quick: bool) -> Params:
        return cls((1, 2, 4), 3) if quick else cls((1, 2, 4, 8, 16), 7)


# -- the client processes --------------------------------------------------------------
def worker(conn: Connection, url: str, index: int) -> None:
    """One client: set up, answer "ready", then run rounds until told to stop."""
    import numpy as np

    import kvstore
    from kvstore.keys import ROOT as ROOT_KEY
    from kvstore.keys import Namespace
    from kvstore.sdk.client import chunk_header
    from kvstore.types import PutStatus

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    src, dst = random_bytes(CHUNK, index), touched(CHUNK)
    ns = Namespace(model="bench-concurrency", dtype="bfloat16", layout=f"client-{index}")
    shape = (256, CHUNK // 512)
    headers = [
        chunk_header(ns, ROOT_KEY, np.arange(256) + 256 * i, src, "bfloat16", shape)
        for i in range(OPS + 1)
    ]
    get_h, put_hs = headers[0], headers[1:]
    save_ns = Namespace(model="bench-concurrency", dtype="bfloat16", layout=f"save-{index}")
    save_shape = (256, SAVE_CHUNK // 512)
    saves = 0  # rounds of saves so far: each saves chunks of its own
    kept: list[bytes] = []

    def save_headers(r: int) -> list[Any]:
        first = 256 * SAVE_BATCH * r
        return [
            chunk_header(
                save_ns, ROOT_KEY, np.arange(256) + first + 256 * i, None, "bfloat16", save_shape
            )
            for i in range(SAVE_BATCH)
        ]

    save_src = [src[i * SAVE_CHUNK % CHUNK :][:SAVE_CHUNK] for i in range(SAVE_BATCH)]
    with kvstore.Client(url, shm=True, timeout=120) as client:
        if not client.shm_active or not client.put(get_h, src).ok:
            conn.send(("error", "no shared memory, or the first put failed"))
            return
        time.sleep(1.0)  # the client's background prefault of the arena
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            kind, start_at = cmd
            if kind.startswith("save"):
                if kept:  # the last round's, written down by now: their pages are reused
                    client.delete(kept)
                    kept = []
                save_hs = save_headers(saves)
                saves += 1
            while time.perf_counter() < start_at:
                time.sleep(0.001)
            t0 = time.perf_counter()
            if kind.startswith("save"):
                reservations = client.reserve(save_hs)
                for res, data in zip(reservations, save_src, strict=True):
                    if isinstance(res, PutStatus):
                        conn.send(("error", f"client {index}: reserve answered {res}"))
                        return
                    res.write(data)  # hashed as it is copied
                done = client.commit(reservations)  # type: ignore[arg-type]
                if done != [PutStatus.STORED] * SAVE_BATCH:
                    conn.send(("error", f"client {index}: commit answered {done}"))
                    return
            for h in put_hs if not kind.startswith("save") else ():
                if kind == "memcpy":
                    np.copyto(dst, src)
                elif kind == "get":
                    client.get_into(get_h.key, dst)
                elif not client.put(h, src).ok:
                    conn.send(("error", f"client {index}: put refused"))
                    return
            t1 = time.perf_counter()
            if kind == "put":
                client.delete([h.key for h in put_hs])
            elif kind == "save":
                client.delete([h.key for h in save_hs])
            elif kind == "save_kept":  # left for the write-down, deleted before the next
                kept = [h.key for h in save_hs]
            elif kind == "get" and not np.array_equal(dst, src):
                conn.send(("error", f"client {index}: get_into delivered other bytes"))
                return
            conn.send(("done", (t0, t1)))


class Clients:
    """``n`` spawned client processes (spawn: never fork a process that runs gRPC)."""

    def __init__(self, url: str, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, url, i), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self, progress: Progress) -> None:
        for conn in progress(self.conns, desc="starting client processes"):
            if not conn.poll(180):
                raise RuntimeError("a client process did not start in 180 s")
            self._expect(conn, "ready")

    @staticmethod
    def _expect(conn: Connection, what: str) -> Any:
        try:
            tag, payload = conn.recv()
        except EOFError:
            raise RuntimeError("a client process died") from None
        if tag != what:
            raise RuntimeError(f"client process: {payload}")
        return payload

    def round(self, n: int, kind: str) -> float:
        """One round of ``kind`` by the first ``n`` clients: aggregate GB/s."""
        start_at = time.perf_counter() + START_DELAY_S
        for conn in self.conns[:n]:
            conn.send((kind, start_at))
        spans = [self._expect(conn, "done") for conn in self.conns[:n]]
        elapsed = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        return n * OPS * CHUNK / elapsed / GB

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


# -- the suite -------------------------------------------------------------------------------
def measure(
    p: Params, progress: Progress, *, disk: bool = False
) -> dict[int, dict[str, list[float]]]:
    """GB/s of each kind for each number of clients. ``disk``: saves only, against a
    server that writes every chunk through to LMDB (L2), as it does by default
    (``save_kept``: the chunks stay until the write-down has copied them, which it does
    while the next saves come in or after, untimed, before the next round; then they
    are deleted, so the next round reuses their pages as ``save`` does)."""
    kinds = ("memcpy", "save_kept") if disk else KINDS
    most = max(p.clients)
    # Every client's stored chunk and one round of puts, twice over (64 KiB pages).
    memory = 2 * most * (OPS + 1) * (CHUNK + 64 * 1024) + 64 * MiB
    memory += 2 * most * SAVE_BATCH * (SAVE_CHUNK + 64 * 1024)  # a round of saves
    work = Path(tempfile.mkdtemp(prefix="kvstore-concurrency-"))
    server: Any = KVServer(work, "kv", memory=str(memory)) if disk else ServerProcess(work, memory)
    clients: Clients | None = None
    try:
        server.start()
        url = server.unix_url if disk else server.url
        clients = Clients(url, most)
        clients.wait_ready(progress)
        rng = random.Random(0)
        out: dict[int, dict[str, list[float]]] = {}
        for n in p.clients:
            got: dict[str, list[float]] = {k: [] for k in kinds}
            for rep in progress(range(p.reps + 1), desc=f"{n} client(s)", total=p.reps + 1):
                order = list(kinds)
                rng.shuffle(order)
                for kind in order:
                    gbs = clients.round(n, kind)
                    if kind == "save_kept":
                        _drained(url)
                    if rep:  # the first repetition warms up
                        got[kind].append(gbs)
            out[n] = got
        return out
    finally:
        if clients is not None:
            clients.close()
        if disk:
            server.stop()
        else:
            server.close()
        shutil.rmtree(work, ignore_errors=True)


def _drained(url: str, timeout: float = 300.0) -> None:
    """Wait until the server's write-down queue is empty."""
    import kvstore

    deadline = time.monotonic() + timeout
    with kvstore.Client(url) as c:
        while c.stats().pending_writes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the write-down did not drain in {timeout:.0f} s")
            time.sleep(0.01)


def records(
    results: dict[int, dict[str, list[float]]], l2: dict[int, dict[str, list[float]]] | None = None
) -> list[Record]:
    """``l2``: the saves again against a server writing through to LMDB."""
    out: list[Record] = []
    one = median(results[min(results)]["memcpy"])
    runs = [("", results)] + ([("_l2", l2)] if l2 else [])
    for suffix, res in runs:
        for n, got in res.items():
            limit = median(got["memcpy"])
            for kind, what in (
                ("put", "Client.put (Reserve, copy, Commit)"),
                ("get", "Client.get_into (Acquire, copy, Release)"),
                ("save", "16 x 1 MiB: Client.reserve (ReserveMany), writes hashed, Client.commit"),
            ):
                kind_got = got.get("save_kept" if suffix and kind == "save" else kind)
                if kind_got is None:
                    continue
                where = "written through to LMDB" if suffix else "L1 only"
                out.append(
                    Record(
                        f"concurrency.{kind}{suffix}.clients={n}",
                        median(kind_got),
                        "GB/s",
                        limit,
                        limit_name=LIMIT,
                        notes=f"{n} client process(es), 16 MiB each per round, shared memory "
                        f"over one kvstore-server ({where}); {what}; aggregate",
                    )
                )
            if suffix:
                continue
            out.append(
                Record(
                    f"concurrency.memcpy.clients={n}",
                    limit,
                    "GB/s",
                    one,
                    limit_name="memcpy by 1 process",
                    notes="how the limit itself scales with parallel processes on this machine",
                )
            )
    return out  # fmt: skip


def run(quick: bool, progress: Progress) -> list[Record]:
    p = Params.make(quick)
    l2 = Params((1, 2, 4), p.reps)  # the writers of one host's engines (issue 12)
    return records(measure(p, progress), measure(l2, progress, disk=True))
