"""A mixed load of kvstore clients (put, get, lookup, delete) that verifies every read.

Used by the fault suite (tests/faults) and by the soak (benchmarks/soak.py).
Needs only a running kvstore-server and the SDK.

Every chunk's payload is a function of its key (``payload_for``), so any
client can check any read byte for byte without asking the writer. Each client
puts and deletes only in its own namespace (one thread changes a key, so its
state is exact), and reads and looks up in everybody's. Per key the shared
``Ledger`` keeps a version and whether it is live (acknowledged as stored and not
deleted since); a reader snapshots both before a get, so a miss counts as *lost*
only when the key was live, unchanged, for the whole call. Wrong bytes, a wrong
header, or a lookup that names another prompt's chunk count as *wrong*.

A fault (the server killed, a remote stopped) makes calls fail with
``ServerUnavailable`` or ``DeadlineExceeded``: those are counted as
``unavailable``, an unacknowledged put never makes its key live, and a delete
that may or may not have happened makes it not live. ``pause``/``resume`` park
every worker between operations, so a test can restart the server and reconcile
(``reconcile``) without readers racing it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvstore
from kvstore.errors import (
    CorruptRecord,
    DeadlineExceeded,
    KVStoreError,
    ResourceExhausted,
    ServerUnavailable,
)
from kvstore.keys import ROOT, ChunkKey, Namespace, chunk_key, tokens_to_bytes
from kvstore.records import RecordHeader

__all__ = ["DOWN", "Ledger", "Mix", "MixConfig", "Tally", "payload_for", "reconcile", "wait_for"]

DOWN = (ServerUnavailable, DeadlineExceeded)  # what a fault makes calls raise


def payload_for(key: bytes, nbytes: int) -> np.ndarray:
    """The payload every chunk with this key carries: random bytes seeded by the key."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


@dataclass
class Tally:
    """Counts of one run of the mix (all threads)."""

    requests: int = 0
    puts: int = 0
    stored: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    deletes: int = 0
    unavailable: int = 0  # calls refused or cut short by an injected fault
    full: int = 0  # puts answered FULL/TOO_LARGE/UNAVAILABLE (back-pressure, a clear status)
    wrong: int = 0  # bytes, header or lookup answer that do not match what was stored
    lost: int = 0  # a live, acknowledged chunk missing
    errors: int = 0  # any other exception: a defect
    slowest: float = 0.0  # seconds of the slowest operation (a put may be several calls)
    details: list[str] = field(default_factory=list)  # first few wrong/lost/error messages

    def note(self, kind: str, msg: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.details) < 20:
            self.details.append(f"{kind}: {msg}")

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            if name == "details":
                self.details.extend(other.details[: max(0, 20 - len(self.details))])
            elif name == "slowest":
                self.slowest = max(self.slowest, other.slowest)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if k != "details"}


class Ledger:
    """Shared state of every key the mix has put: version, live, payload bytes, durable."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version: dict[ChunkKey, int] = {}
        self.live: dict[ChunkKey, bool] = {}
        self.size: dict[ChunkKey, int] = {}
        self.durable: set[ChunkKey] = set()  # seen on disk (tier 2) while live
        self.live_list: list[ChunkKey] = []  # for random picks; may hold dead keys
        self.acked = 0

    def snapshot(self, key: ChunkKey) -> tuple[int, bool]:
        with self.lock:
            return self.version.get(key, 0), self.live.get(key, False)

    def stored(self, key: ChunkKey, nbytes: int) -> None:
        with self.lock:
            self.version[key] = self.version.get(key, 0) + 1
            if not self.live.get(key):
                self.live_list.append(key)
            self.live[key] = True
            self.size[key] = nbytes
            self.acked += 1

    def gone(self, key: ChunkKey) -> None:
        """About to delete (or unsure whether it survived): no longer promised."""
        with self.lock:
            self.version[key] = self.version.get(key, 0) + 1
            self.live[key] = False
            self.durable.discard(key)

    def pick(self, rng: random.Random) -> ChunkKey | None:
        with self.lock:
            for _ in range(4):
                if not self.live_list:
                    return None
                i = rng.randrange(len(self.live_list))
                key = self.live_list[i]
                if self.live.get(key):
                    return key
                self.live_list[i] = self.live_list[-1]  # drop a dead key, O(1)
                self.live_list.pop()
            return None

    def live_keys(self) -> list[ChunkKey]:
        with self.lock:
            return [k for k, v in self.live.items() if v]


@dataclass
class MixConfig:
    url: str | Sequence[str]  # one URL, or one per client (round robin)
    clients: int = 16
    seconds: float = 15.0
    max_ops: int = 1_000_000  # per client
    chunk_tokens: int = 16
    bytes_per_token: int = 1024
    prompts: int = 12  # prompts per client, 1-4 chunks, sharing first chunks in families
    weights: tuple[float, float, float, float] = (0.35, 0.4, 0.15, 0.1)  # put get lookup delete
    timeout: float = 5.0
    tolerate_down: bool = False  # count ServerUnavailable/DeadlineExceeded instead of failing
    evictions: bool = False  # capacity runs: a live chunk may be evicted, a miss is not lost
    token: str | None = None
    shm: Callable[[int], bool | None] = lambda i: None  # data plane per client index
    seed: int = 0
    tag: str = "mix"


class _Prompt:
    def __init__(self, ns: Namespace, tokens: np.ndarray, chunk_tokens: int) -> None:
        self.tokens = tokens
        self.chunks = [tokens[s : s + chunk_tokens] for s in range(0, len(tokens), chunk_tokens)]
        self.keys: list[ChunkKey] = []
        parent = ROOT
        for part in self.chunks:
            parent = chunk_key(parent, ns.fingerprint, tokens_to_bytes(part))
            self.keys.append(parent)


class Mix:
    """Run ``MixConfig.clients`` client threads until ``seconds`` pass or ``stop()``."""

    def __init__(self, cfg: MixConfig, ledger: Ledger | None = None) -> None:
        self.cfg = cfg
        self.ledger = ledger or Ledger()
        self.tally = Tally()
        self._stop = threading.Event()
        self._run = threading.Event()  # cleared by pause()
        self._run.set()
        self._idle = threading.Semaphore(0)
        self._cv = threading.Condition()
        self._parked = 0
        self._threads: list[threading.Thread] = []
        self._tallies: list[Tally] = []
        self.namespaces: list[Namespace] = []
        self.started = 0.0

    # -- control ---------------------------------------------------------------------------
    def start(self) -> Mix:
        self.started = time.monotonic()
        for i in range(self.cfg.clients):
            t = Tally()
            self._tallies.append(t)
            ns = Namespace(
                model="faults-mix",
                dtype="bfloat16",
                layout=f"{self.cfg.tag}-{self.cfg.seed}-{i}-bpt{self.cfg.bytes_per_token}",
            )
            self.namespaces.append(ns)
            th = threading.Thread(
                target=self._worker, args=(i, ns, t), daemon=True, name=f"mix-{i}"
            )
            self._threads.append(th)
            th.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._run.set()

    def join(self, timeout: float = 60.0) -> Tally:
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.1, deadline - time.monotonic()))
        stuck = [th.name for th in self._threads if th.is_alive()]
        total = Tally()
        for t in self._tallies:
            total.add(t)
        if stuck:
            total.note("errors", f"client threads still running after {timeout} s: {stuck}")
        self.tally = total
        return total

    def run(self) -> Tally:
        self.start()
        return self.join(self.cfg.seconds + 60)

    def pause(self, timeout: float = 30.0) -> bool:
        """Park every worker between operations; True when all are parked."""
        self._run.clear()
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._parked < sum(th.is_alive() for th in self._threads):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def resume(self) -> None:
        self._run.set()

    @property
    def done(self) -> bool:
        return self._stop.is_set() or time.monotonic() - self.started > self.cfg.seconds

    # -- the worker --------------------------------------------------------------------------
    def _park(self) -> None:
        with self._cv:
            self._parked += 1
            self._cv.notify_all()
        self._run.wait()
        with self._cv:
            self._parked -= 1

    def _worker(self, i: int, ns: Namespace, t: Tally) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000 + i)
        url = cfg.url if isinstance(cfg.url, str) else cfg.url[i % len(cfg.url)]
        families = [
            np.array([rng.randrange(1, 50_000) for _ in range(cfg.chunk_tokens)], dtype=np.uint32)
            for _ in range(3)
        ]
        prompts = []
        for _ in range(cfg.prompts):
            n = rng.randint(1, 4) * cfg.chunk_tokens - rng.choice([0, 0, cfg.chunk_tokens // 2])
            tail = np.array(
                [rng.randrange(1, 50_000) for _ in range(max(0, n - cfg.chunk_tokens))],
                dtype=np.uint32,
            )
            toks = np.concatenate([rng.choice(families), tail])[: max(n, 1)]
            prompts.append(_Prompt(ns, toks, cfg.chunk_tokens))
        try:
            client = kvstore.Client(url, timeout=cfg.timeout, shm=cfg.shm(i), token=cfg.token)
        except KVStoreError as e:
            t.note("errors", f"client {i}: cannot create: {e}")
            return
        ops = (self._put, self._get, self._lookup, self._delete)
        try:
            for _ in range(cfg.max_ops):
                if not self._run.is_set():
                    self._park()
                if self.done:
                    return
                op = rng.choices(ops, weights=cfg.weights)[0]
                t.requests += 1
                t0 = time.perf_counter()
                try:
                    op(client, rng, ns, prompts, t)
                    t.slowest = max(t.slowest, time.perf_counter() - t0)
                except DOWN as e:
                    if not cfg.tolerate_down:
                        t.note("errors", f"client {i} {op.__name__}: {type(e).__name__}: {e}")
                    else:
                        t.unavailable += 1
                        time.sleep(0.02)  # a dead server refuses at once: do not spin
                except ResourceExhausted as e:
                    t.full += 1
                    if len(t.details) < 20:
                        t.details.append(f"resource exhausted (clear status): {e}")
                except Exception as e:
                    t.note("errors", f"client {i} {op.__name__}: {type(e).__name__}: {e}")
        finally:
            client.close()
            with self._cv:
                self._cv.notify_all()

    def _put(
        self, c: kvstore.Client, rng: random.Random, ns: Namespace, prompts: list[_Prompt], t: Tally
    ) -> None:
        p = rng.choice(prompts)
        bpt = self.cfg.bytes_per_token
        parent = ROOT
        for part, key in zip(p.chunks, p.keys, strict=True):
            nbytes = len(part) * bpt
            data = payload_for(key, nbytes)
            t.puts += 1
            try:
                got, status = c.put_chunk(ns, parent, part, data, "bfloat16", (len(part), bpt // 2))
            except BaseException:
                self.ledger.gone(key)  # maybe stored, maybe not: promise nothing
                raise
            if got != key:
                t.note(
                    "wrong", f"put_chunk returned key {got.hex()[:16]}, expected {key.hex()[:16]}"
                )
                return
            if status.ok:
                t.stored += 1
                self.ledger.stored(key, nbytes)
            else:
                t.full += 1
                return
            parent = key

    def _get(
        self, c: kvstore.Client, rng: random.Random, ns: Namespace, prompts: list[_Prompt], t: Tally
    ) -> None:
        key = self.ledger.pick(rng)
        if key is None:
            return
        before = self.ledger.snapshot(key)
        t.gets += 1
        try:
            if rng.random() < 0.3:
                out = np.zeros(self.ledger.size.get(key, 0) + 8, dtype=np.uint8)
                header = c.get_into(key, out)
                got: tuple[RecordHeader, Any] | None = (
                    None if header is None else (header, out[: header.raw_size])
                )
            else:
                got = c.get(key)
        except CorruptRecord as e:
            t.note("errors", f"get {key.hex()[:16]}: corrupt record reached the client: {e}")
            return
        if got is None:
            t.misses += 1
            if before[1] and self.ledger.snapshot(key) == before and not self.cfg.evictions:
                t.note("lost", f"live chunk {key.hex()[:16]} (version {before[0]}) missing")
            return
        t.hits += 1
        header, data = got
        want = payload_for(key, header.raw_size)
        if header.key != key or not np.array_equal(np.frombuffer(data, np.uint8), want):
            t.note(
                "wrong",
                f"get {key.hex()[:16]}: header key {header.key.hex()[:16]}, "
                f"{header.raw_size} bytes differ from what was stored",
            )

    def _lookup(
        self, c: kvstore.Client, rng: random.Random, ns: Namespace, prompts: list[_Prompt], t: Tally
    ) -> None:
        p = rng.choice(prompts)
        # Only this thread changes this namespace: its live prefix is exact.
        live_run = 0
        for key in p.keys:
            if not self.ledger.snapshot(key)[1]:
                break
            live_run += 1
        floor = min(live_run * self.cfg.chunk_tokens, len(p.tokens))
        t.lookups += 1
        r = c.lookup(ns, p.tokens)
        if r.matched_tokens > len(p.tokens) or r.total_tokens != len(p.tokens):
            t.note(
                "wrong",
                f"lookup matched {r.matched_tokens} of {r.total_tokens} tokens, "
                f"prompt has {len(p.tokens)}",
            )
        for j, m in enumerate(r.chunks):
            if not m.partial and (j >= len(p.keys) or m.key != p.keys[j]):
                t.note("wrong", f"lookup chunk {j} is {m.key.hex()[:16]}, not the prompt's")
                break
        granularity_floor = floor - floor % 4
        if r.matched_tokens < granularity_floor and not self.cfg.evictions:
            t.note(
                "lost",
                f"lookup matched {r.matched_tokens} tokens; {live_run} live chunks "
                f"({floor} tokens) are stored",
            )

    def _delete(
        self, c: kvstore.Client, rng: random.Random, ns: Namespace, prompts: list[_Prompt], t: Tally
    ) -> None:
        p = rng.choice(prompts)
        live = [k for k in p.keys if self.ledger.snapshot(k)[1]]
        if not live:
            return
        key = rng.choice(live)
        self.ledger.gone(key)
        t.deletes += 1
        c.delete([key])

    # -- after a fault ---------------------------------------------------------------------
    def probe_durable(self, client: kvstore.Client, limit: int = 2000) -> int:
        """Mark live keys the server reports on disk (tier 2) as durable; how many are."""
        with self.ledger.lock:
            todo = [k for k, v in self.ledger.live.items() if v and k not in self.ledger.durable]
        todo = todo[-limit:]
        for s in range(0, len(todo), 500):
            batch = todo[s : s + 500]
            before = [self.ledger.snapshot(k) for k in batch]
            found = client.exists(batch)
            with self.ledger.lock:
                for k, b, tiers in zip(batch, before, found, strict=True):
                    if 2 in tiers and (self.ledger.version.get(k, 0), self.ledger.live.get(k)) == b:
                        self.ledger.durable.add(k)
        return len(self.ledger.durable)


def reconcile(ledger: Ledger, client: kvstore.Client, *, verify: bool = True) -> dict[str, Any]:
    """After a crash and restart: every durable key must be there (else lost), every key
    found must read back byte-exact (else wrong); live keys that were only in memory and
    are gone now are dropped from the ledger (``volatile``: acknowledged, not written down).
    """
    keys = ledger.live_keys()
    out: dict[str, Any] = {
        "checked": len(keys),
        "lost": 0,
        "wrong": 0,
        "volatile": 0,
        "found": 0,
        "details": [],
    }
    for s in range(0, len(keys), 500):
        batch = keys[s : s + 500]
        found = client.exists(batch)
        for key, tiers in zip(batch, found, strict=True):
            if tiers:
                out["found"] += 1
                if not verify:
                    continue
                got = client.get(key)
                if got is None:
                    tiers = ()
                else:
                    header, data = got
                    if header.key != key or data != payload_for(key, header.raw_size).tobytes():
                        out["wrong"] += 1
                        out["details"].append(f"wrong bytes for {key.hex()[:16]}")
            if not tiers:
                if key in ledger.durable:
                    out["lost"] += 1
                    out["details"].append(f"durable chunk {key.hex()[:16]} lost")
                else:
                    out["volatile"] += 1
                ledger.gone(key)
    return out


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> float:
    """Poll ``cond`` until true; seconds it took. AssertionError naming ``what`` on timeout."""
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - t0
        except KVStoreError:
            pass
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
