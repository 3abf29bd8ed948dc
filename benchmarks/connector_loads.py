"""The connector's load path in a vLLM engine: bandwidth into the paged KV cache, and warm
time to first token against the engine's compute floor (part of the connector suite).

Two kvstore engines (``benchmarks/ttft_driver.py``) on one random Llama share one
kvstore-server (L1 arena and an LMDB L2): ``auto`` (the default ``load_mode``: an L1
hit is loaded in the step that computes the rest, a hit on disk in the background)
and ``async`` (``load_mode: async``: every hit waits while a worker thread loads it).
vLLM's own prefix cache is on in both, which is how the floor is measured. The engines
reserve one CPU (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``) and the server runs there
(``--cpus``, ``server_cpus``), as a host serving a CPU engine deploys it:

- warm: vLLM's prefix cache is emptied (``reset_prefix_cache``), then the prompt runs:
  its KV comes from kvstore (``n - 1`` of ``n = k * 128 + 1`` tokens), one token is
  computed.
- floor: the same prompt again, right after: now every block is in vLLM's own cache,
  so the same one-token tail is computed and the load takes no time. Same engine, same
  tail, same scheduling; warm / floor is what loading costs on top of the compute.

Load bandwidth is the connector's own figure (its log line: tokens loaded and the time
of the load, from the first call to the last byte in the cache, verified) as bytes per
second, against a single-thread memcpy of the same number of bytes in this process,
measured between the engine runs. From L2: other chunks worth more than L1 are put
into the server (another namespace, written through), so the prompt is in LMDB only,
as in a running server whose L1 other traffic turned over; the warm run then loads it
in the background. Its bandwidth is set against a raw LMDB read (a fresh environment in
the scratch directory holding the same number of values of the same sizes, read back in
one transaction into a buffer of their size, page cache warm as the server's is). The
same after restarting the server on its data (L1 empty, and the engine's clients find
the new server during the load) is reported beside it.

Decodes around a load: with the longest prompt pushed out of L1 again (on disk only),
the ``auto`` engine runs ``itl_decodes`` decoding requests; once each has
``ITL_BEFORE`` tokens, the longest prompt joins the batch and is loaded in the
background from LMDB. The decodes' inter-token gaps (one engine step each) while it
loads (from its arrival to the step before its first token) are set against their gaps
before it arrived, same run; the step that then runs it (one token attending over the
whole prefix) against the same step when the prompt is in vLLM's own cache (the same
decodes again, right after: no load at all); and the whole window, arrival to first
token, against the gaps before, as before.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .engines import EngineProcess, engine_env, kv_bytes_per_token, kvstore_connector
from .harness import Progress, Record, module

DRIVER = module("ttft_driver")
BLOCK = 128
SETTLE_S = 1.5  # > vLLM's busy_loop_s (1 s): let the other engine go idle first
LOAD_LINE = re.compile(
    r"kvstore: loaded (\d+) of (\d+) tokens for \d+ request\(s\) in ([\d.]+) ms"
    r"( in the background)?(?: layer by layer, ([\d.]+) ms of it in the step)?"
)
CHUNK_TOKENS = 256
EVICT_BYTES = 256 << 20  # written between raw reads: 8x this host's L3


@dataclass(frozen=True)
class LoadParams:
    lengths: tuple[int, ...]  # k * 128 + 1: the warm run and the floor both compute 1 token
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    reps: int
    l2_reps: int
    itl_reps: int  # loads of the longest prompt from L2 while decodes run
    itl_decodes: int = 4
    dtype: str = "bfloat16"
    vocab: int = 1024

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.hidden, self.heads, self.kv_heads, self.dtype)

    @property
    def max_model_len(self) -> int:
        return max(self.lengths) + 2 * BLOCK

    def describe(self) -> str:
        return (
            f"random Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"{self.kv_heads} KV heads, {self.dtype} ({self.kv_bytes_per_token // 1024} KiB "
            "of KV a token)"
        )


# The model: 8 KiB of KV a token, so 4k tokens are 32 MiB and 16k 128 MiB.
FULL = LoadParams((4097, 16385), 8, 1024, 16, 4, 5, 3, 3)
QUICK = LoadParams((1025, 2049), 2, 256, 4, 2, 3, 1, 1)
ITL_BEFORE, ITL_AFTER = 24, 12  # decode steps before the load joins, after its first token


@dataclass
class Runs:
    """What one engine measured on one prompt length."""

    warm: list[dict[str, Any]] = field(default_factory=list)
    floor: list[dict[str, Any]] = field(default_factory=list)
    l2: list[dict[str, Any]] = field(default_factory=list)  # after a server restart
    evicted: list[dict[str, Any]] = field(default_factory=list)  # pushed out of L1 by others

    @staticmethod
    def median(runs: list[dict[str, Any]], key: str = "seconds") -> float:
        return statistics.median(r[key] for r in runs)


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """Single-thread memcpy of ``nbytes`` here (numpy's copy is glibc memcpy), GB/s."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # faulted in
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - t0)
    return nbytes / statistics.median(best) / 1e9


def lmdb_gbps(work: Path, nbytes: int, value_bytes: int, reps: int = 5) -> float:
    """A raw LMDB read of ``nbytes`` in values of ``value_bytes`` (one transaction, each
    value copied into its place in one buffer of ``nbytes``, touched, as a load copies
    each chunk into its blocks), GB/s. Copied into fresh ``bytes`` instead, each value
    lands in memory the allocator just freed, in the CPU's caches: that read ran at
    26-29 GB/s here, twice a memcpy of the same bytes, a limit of the caches, not of
    LMDB. For the same reason a scratch buffer of ``EVICT_BYTES`` is written before
    each read: the L2 hits it is set against were pushed out of L1 by other chunks,
    and out of the CPU's caches with them, where a read repeated on the same 32 MiB
    found much of it still in this host's 32 MiB L3 (17.8-18.4 GB/s against a 12 GB/s
    memcpy)."""
    import lmdb

    n = max(1, nbytes // value_bytes)
    path = work / "raw-lmdb"
    env = lmdb.open(str(path), map_size=2 * n * value_bytes + (64 << 20), max_dbs=2)
    try:
        payload = np.random.default_rng(0).integers(0, 255, value_bytes, dtype=np.uint8).tobytes()
        with env.begin(write=True) as txn:
            for i in range(n):
                txn.put(i.to_bytes(8, "big"), payload)
        dst = np.ones(n * value_bytes, dtype=np.uint8)
        firsts = dst[::value_bytes]  # each value's first byte, marked unread before each rep
        times = []
        scratch = np.zeros(EVICT_BYTES, dtype=np.uint8)
        for rep in range(reps):
            firsts[:] = payload[0] ^ 0xFF
            scratch[:] = rep + 1  # the values and the buffer out of the CPU's caches
            t0 = time.perf_counter()
            with env.begin(buffers=True) as txn:
                for i in range(n):
                    view = txn.get(i.to_bytes(8, "big"))
                    assert view is not None
                    dst[i * value_bytes : (i + 1) * value_bytes] = np.frombuffer(view, np.uint8)
            times.append(time.perf_counter() - t0)
            assert (firsts == payload[0]).all(), "a value was not read"
        return n * value_bytes / statistics.median(times) / 1e9
    finally:
        env.close()


def push_out_of_l1(url: str, l1_bytes: int, tag: str) -> None:
    """Put other chunks (another namespace) worth more than L1 into the server, and wait
    until they are on disk too: what was in L1 before, the prompts included, is now in
    LMDB only, as in a server whose L1 other traffic turned over."""
    import kvstore
    from kvstore.keys import ROOT, Namespace

    size = 2 << 20
    payload = np.random.default_rng(7).integers(0, 255, size, dtype=np.uint8)
    ns = Namespace(model=f"bench-junk-{tag}")
    with kvstore.Client(url, timeout=60) as c:
        parent = ROOT
        for i in range(int(l1_bytes * 1.25) // size + 1):
            parent, status = c.put_chunk(ns, parent, [i] * CHUNK_TOKENS, payload, "uint8", (size,))
            if not status.ok:
                raise AssertionError(f"pushing the prompts out of L1: a put got {status}")
        deadline = time.monotonic() + 120
        while (pending := c.stats().pending_writes) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pending:  # a prompt still in L1 would be measured as an L2 hit
            raise AssertionError(f"pushing the prompts out of L1: {pending} writes still pending")


def lent_chunks(url: str) -> tuple[int, int]:
    """Chunks the server has lent from L2's file in place since it started (loans), and
    the AcquireMany calls it answered (none where the lookups lent the leases)."""
    import kvstore

    with kvstore.Client(url, timeout=60) as c:
        st = c.stats()
        return int(st.tiers[1].detail.get("lent", 0)), int(
            st.extra["requests"].get("AcquireMany", 0)
        )


def server_cpus() -> list[str]:
    """The server's ``--cpus``, as a host running a CPU engine deploys it: the core vLLM
    leaves free (``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` reserves the last one it may use, and
    binds its compute threads to the rest); none on a one-CPU host."""
    cpus = sorted(os.sched_getaffinity(0))
    return ["--cpus", str(cpus[-1])] if len(cpus) > 1 else []


def load_of(run: dict[str, Any]) -> tuple[int, float, bool]:
    """(tokens, seconds, in the background) of the connector's load in one warm run."""
    loads = [m for m in map(LOAD_LINE.search, run["log"]) if m]
    if not loads:
        raise AssertionError("the connector logged no load: this warm run measured a miss")
    tokens = sum(int(m.group(1)) for m in loads)
    asked = sum(int(m.group(2)) for m in loads)
    if tokens != asked:
        raise AssertionError(f"the connector loaded {tokens} of {asked} tokens: vLLM recomputed")
    return tokens, sum(float(m.group(3)) for m in loads) / 1e3, any(m.group(4) for m in loads)


def in_step_of(run: dict[str, Any]) -> float | None:
    """Seconds of a warm run's load that its step waited for (a load copied layer by
    layer beside the forward pass: taking the leases and the waits for layers); None for a
    load copied before the forward pass (all of it)."""
    loads = [m for m in map(LOAD_LINE.search, run["log"]) if m and m.group(5)]
    return sum(float(m.group(5)) for m in loads) / 1e3 if loads else None


def measure(p: LoadParams, progress: Progress, work: Path) -> dict[str, Any]:
    from kvstore.testing.server import KVServer
    from kvstore.testing.tinymodel import make_tiny_llama

    model = make_tiny_llama(
        work / "model-loads", layers=p.layers, hidden=p.hidden, heads=p.heads,
        kv_heads=p.kv_heads, vocab=p.vocab, max_position_embeddings=p.max_model_len,
        dtype=p.dtype,
    )  # fmt: skip
    stored = sum(p.lengths) + 4 * BLOCK
    l1_bytes = 2 * stored * p.kv_bytes_per_token + (64 << 20)
    server = KVServer(
        work / "srv-loads", memory=str(l1_bytes),
        args=["--log-level", "warning", *server_cpus()],
    )  # fmt: skip
    env = engine_env(2 * p.max_model_len * p.kv_bytes_per_token)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "7200"
    engines: dict[str, EngineProcess] = {}
    out: dict[str, Any] = {"lengths": {}, "memcpy": [], "lmdb": {}, "itl": []}
    try:
        server.start()
        for mode in ("auto", "async"):
            kv = kvstore_connector(server.unix_url)
            kv["kv_connector_extra_config"].update(load_mode=mode, retry_after_ms=200)
            spec = {"model": str(model), "dtype": p.dtype, "max_model_len": p.max_model_len,
                    "vocab": p.vocab, "kv_transfer_config": kv,
                    "llm": {"enable_prefix_caching": True,
                            "max_num_seqs": p.itl_decodes + 4}}  # fmt: skip
            engines[mode] = EngineProcess(f"loads-{mode}", DRIVER, spec, work, env)
        for e in progress(list(engines.values()), desc="starting 2 vLLM engines"):
            e.wait_ready()
        for e in engines.values():  # first forward passes, the arena mapping
            for seed in (990, 991):
                e.request({"n": 2 * BLOCK + 1, "seed": seed})
                e.request({"reset": True})
                e.request({"n": 2 * BLOCK + 1, "seed": seed})
        last = ""

        def run(name: str, cmd: dict[str, Any]) -> dict[str, Any]:
            nonlocal last
            if last and last != name:
                time.sleep(SETTLE_S)
            last = name
            return engines[name].request(cmd, settle_s=0.3 if "n" in cmd else 0.0)

        for i, n in enumerate(progress(list(p.lengths), desc="prompt lengths")):
            seed = 500 + i
            cold = run("auto", {"n": n, "seed": seed})
            if cold["num_cached_tokens"]:
                raise AssertionError(f"{n} tokens: the cold run hit ({cold})")
            runs = {name: Runs() for name in engines}
            for r in range(p.reps):
                for name in engines if r % 2 == 0 else reversed(engines):
                    run(name, {"reset": True})
                    runs[name].warm.append(run(name, {"n": n, "seed": seed}))
                    runs[name].floor.append(run(name, {"n": n, "seed": seed}))
                out["memcpy"].append(memcpy_gbps((n - 1) * p.kv_bytes_per_token))
            for rep in range(p.l2_reps):  # pushed out of L1 by other chunks, on disk still
                push_out_of_l1(server.unix_url, l1_bytes, f"{n}-{rep}")
                run("auto", {"reset": True})
                lent, calls = lent_chunks(server.unix_url)
                runs["auto"].evicted.append(run("auto", {"n": n, "seed": seed}))
                now_lent, now_calls = lent_chunks(server.unix_url)
                runs["auto"].evicted[-1]["lent"] = now_lent - lent
                runs["auto"].evicted[-1]["acquires"] = now_calls - calls
            for rep in range(p.l2_reps):
                server.stop()
                server.start()  # on its data: L1 empty, every chunk in LMDB
                for k, name in enumerate(engines):  # reconnect (a fresh prompt), then wait
                    run(name, {"n": BLOCK + 1, "seed": 10_000 + 100 * i + 10 * rep + k})
                time.sleep(0.5)
                run("auto", {"reset": True})
                runs["auto"].l2.append(run("auto", {"n": n, "seed": seed}))
            for name, got in runs.items():
                for w in got.warm + got.floor + got.l2 + got.evicted:
                    if w["token"] != cold["token"]:
                        raise AssertionError(
                            f"{name}, {n} tokens: first token {w['token']} != cold "
                            f"{cold['token']}: the loaded KV is not the computed KV"
                        )
            out["lengths"][n] = {"cold": cold, "runs": runs}
            out["lmdb"][n] = lmdb_gbps(
                work, (n - 1) * p.kv_bytes_per_token, CHUNK_TOKENS * p.kv_bytes_per_token
            )
        n, seed = max(p.lengths), 500 + p.lengths.index(max(p.lengths))
        cold_token = out["lengths"][n]["cold"]["token"]
        for rep in progress(range(p.itl_reps), desc="decodes around a load from L2"):
            push_out_of_l1(server.unix_url, l1_bytes, f"itl-{rep}")  # the long prompt: disk only
            time.sleep(0.5)
            run("auto", {"reset": True})
            cmd = {
                "decodes": p.itl_decodes,
                "decode_n": BLOCK + 1,
                "seed": 40_000 + 100 * rep,
                "before": ITL_BEFORE,
                "after": ITL_AFTER,
                "load_n": n,
                "load_seed": seed,
            }
            res = run("auto", {"itl": cmd})
            # The same again, the long prompt now in vLLM's own cache: no load at all, so
            # its first step is what running it costs the decodes without kvstore's part.
            res["floor"] = run("auto", {"itl": {**cmd, "seed": cmd["seed"] + 50}})
            for got in (res, res["floor"]):
                if got.get("token") != cold_token:
                    raise AssertionError(
                        f"decodes around a load: first token {got.get('token')} "
                        f"!= cold {cold_token}: the loaded KV is wrong"
                    )
            if res["floor"].get("num_cached_tokens", 0) < n - BLOCK:
                raise AssertionError(f"decodes, floor: not a prefix-cache hit ({res['floor']})")
            out["itl"].append(res)  # fmt: skip
        return out
    finally:
        for e in engines.values():
            e.close()
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


@dataclass(frozen=True)
class Gaps:
    """The decodes' inter-token gaps (s) in one run around the long prompt's arrival."""

    before: list[float]  # before it joined (the first two steps, their own prefills, left out)
    loading: list[float]  # from its arrival until the step before its first token
    first: float  # the step that computed its first token (one token over its whole prefix)

    @property
    def window(self) -> list[float]:
        return [*self.loading, self.first]


def itl_gaps(run: dict[str, Any], loads: bool = True) -> Gaps:
    """Split a run's step times at the long prompt's arrival and first token; ``loads``:
    the run loaded it (some steps must have run meanwhile)."""
    steps, added, done = run["steps"], run["added"], run["done"]
    gaps = [(b, b - a) for a, b in itertools.pairwise(steps)]
    before = [g for t, g in gaps[2:] if t <= added]
    loading = [g for t, g in gaps if added < t < done - 1e-9]
    first = [g for t, g in gaps if abs(t - done) <= 1e-9]
    if not before or len(first) != 1 or (loads and not loading):
        raise AssertionError(f"decodes around a load: {len(before)} gaps before, "
                             f"{len(loading)} while loading, {len(first)} at its first "
                             "token: nothing to compare")  # fmt: skip
    return Gaps(before, loading, first[0])


def itl_records(p: LoadParams, results: dict[str, Any]) -> list[Record]:
    runs = results["itl"]
    if not runs:
        return []
    n = max(p.lengths)
    loads = [load_of(r) for r in runs]
    if any(not bg for _, _, bg in loads):
        raise AssertionError("decodes around a load: the load from L2 was not in the background")
    gaps = [itl_gaps(r) for r in runs]
    floors = [itl_gaps(r["floor"], loads=False) for r in runs]
    before = [statistics.mean(g.before) for g in gaps]
    loading = [statistics.mean(g.loading) for g in gaps]
    window = [statistics.mean(g.window) for g in gaps]
    first, first_floor = [g.first for g in gaps], [f.first for f in floors]
    worst = [max(g.loading) for g in gaps]
    span = [r["done"] - r["added"] for r in runs]
    med = statistics.median
    ms = lambda xs: ", ".join(f"{x * 1e3:.0f}" for x in sorted(xs))  # noqa: E731
    what = (f"{p.itl_decodes} decodes running; a {n}-token prompt on kvstore's disk only "
            f"(pushed out of L1 by other chunks) joins: loaded in the background in "
            f"{med(s for _, s, _ in loads) * 1e3:.0f} ms, first token after "
            f"{med(span) * 1e3:.0f} ms (median of {len(runs)}); kvstore-server on "
            f"{' '.join(server_cpus()) or 'any CPU'}")  # fmt: skip
    return [
        Record(f"connector.itl.while_l2_load.{n // 1024}k", med(loading), "s", med(before),
               None, "the same decodes' mean inter-token latency before the load request joined",
               "ratio <= 1.2",
               f"{what}; mean ITL while it loads (its arrival to the step before its first "
               f"token: {med(len(g.loading) for g in gaps)} steps) {ms(loading)} ms vs "
               f"before {ms(before)} ms; longest gap while loading {ms(worst)} ms"),
        Record(f"connector.itl.arrival_to_first_token.{n // 1024}k", med(window), "s",
               med(before), None,
               "the same decodes' mean inter-token latency before the load request joined",
               "", f"{what}; mean ITL from its arrival to its first token, the step that "
               f"runs it included, {ms(window)} ms vs before {ms(before)} ms"),
        Record(f"connector.itl.first_step.{n // 1024}k", med(first), "s", med(first_floor),
               None, "the same step with the prompt in vLLM's own cache (no load), same run",
               "", f"{what}; the step that computes its first token (one token over "
               f"{n} tokens of context): {ms(first)} ms after the load, {ms(first_floor)} ms "
               "with its prefix already in vLLM's cache"),
    ]  # fmt: skip


def records(p: LoadParams, results: dict[str, Any]) -> list[Record]:
    memcpy = statistics.median(results["memcpy"])
    out: list[Record] = []
    for n, got in results["lengths"].items():
        label = f"{n // 1024}k"
        runs: dict[str, Runs] = got["runs"]
        sync, asyn = runs["auto"], runs["async"]
        loads = [load_of(w) for w in sync.warm]
        tokens = loads[0][0]
        nbytes = tokens * p.kv_bytes_per_token
        load_s = statistics.median(s for _, s, _ in loads)
        gbps = nbytes / load_s / 1e9
        stepped = [s for s in map(in_step_of, sync.warm) if s is not None]
        how = "; copied before the forward pass"
        if stepped:
            how = (
                f"; copied layer by layer beside the forward pass, "
                f"{statistics.median(stepped) * 1e3:.1f} ms of it in the step "
                "(taking the leases the lookup lent, the waits for layers)"
            )
        l2 = [load_of(w) for w in sync.l2]
        if any(not bg for _, _, bg in l2):
            raise AssertionError(f"{n} tokens: a hit from L2 did not load in the background")
        l2_s = statistics.median(s for _, s, _ in l2)
        ev = [load_of(w) for w in sync.evicted]
        if any(not bg for _, _, bg in ev):
            raise AssertionError(f"{n} tokens: a hit pushed out of L1 loaded in the step")
        ev_s = statistics.median(s for _, s, _ in ev)
        ev_ttft = Runs.median(sync.evicted)
        lent = "/".join(str(w.get("lent", "?")) for w in sync.evicted)
        acquires = "/".join(str(w.get("acquires", "?")) for w in sync.evicted)
        lmdb = results["lmdb"][n]
        warm, floor = Runs.median(sync.warm), Runs.median(sync.floor)
        awarm, afloor = Runs.median(asyn.warm), Runs.median(asyn.floor)
        l2_ttft = Runs.median(sync.l2)
        mb = nbytes / (1 << 20)
        out += [
            Record(f"connector.load.l1_vs_memcpy.{label}", gbps, "GB/s", memcpy, None,
                   "single-thread memcpy of the same bytes, this process, same run",
                   "ratio >= 0.5 (aim 0.8)",
                   f"{tokens} tokens ({mb:.0f} MiB) from L1 into vLLM's paged cache in "
                   f"{load_s * 1e3:.1f} ms (median of {len(loads)}: "
                   f"{', '.join(f'{s * 1e3:.1f}' for _, s, _ in sorted(loads, key=lambda x: x[1]))}"
                   " ms): through the leases the lookup lent (no call), each chunk copied "
                   f"from the arena into its blocks hashed as it lands{how}"),
            Record(f"connector.load.l2_vs_lmdb.{label}", nbytes / ev_s / 1e9, "GB/s", lmdb, None,
                   "raw LMDB read of the same bytes (same value sizes) into a buffer of their "
                   "size, page cache warm", "ratio >= 0.5",
                   f"pushed out of L1 by other chunks (LMDB only, the server running): loaded "
                   f"in the background in {ev_s * 1e3:.1f} ms (median of {len(ev)}: "
                   f"{', '.join(f'{s * 1e3:.0f}' for _, s, _ in sorted(ev, key=lambda x: x[1]))}"
                   f" ms), {lent} chunks of each load lent in place from LMDB's file "
                   f"(AcquireMany calls: {acquires}); TTFT {ev_ttft * 1e3:.0f} ms"),
            Record(f"connector.load.l2_after_restart_vs_lmdb.{label}", nbytes / l2_s / 1e9,
                   "GB/s", lmdb, None, "the same raw LMDB read", "",
                   f"server restarted on its data (L1 empty; the engine's clients find the new "
                   f"server and map its arena during the load): loaded in the background in "
                   f"{l2_s * 1e3:.1f} ms (median of {len(l2)}); TTFT {l2_ttft * 1e3:.0f} ms"),
            Record(f"connector.ttft.warm_vs_floor.{label}", warm, "s", floor, None,
                   "compute floor: same engine, same 1-token tail, prompt in vLLM's own "
                   "prefix cache (no load)", "ratio <= 1.25",
                   f"load_mode auto (L1: in the step), median of {len(sync.warm)}: warm "
                   f"{warm * 1e3:.1f} ms, "
                   f"floor {floor * 1e3:.1f} ms"),
            Record(f"connector.ttft.async_vs_sync.{label}", awarm, "s", warm, None,
                   "warm TTFT with load_mode auto (an L1 hit loaded in the step)", "",
                   f"load_mode async: warm {awarm * 1e3:.1f} ms (its floor "
                   f"{afloor * 1e3:.1f} ms), in the step {warm * 1e3:.1f} ms"),
        ]  # fmt: skip
    return out


def table(p: LoadParams, results: dict[str, Any]) -> str:
    """The figures as a Markdown table (for docs/performance.md)."""
    memcpy = statistics.median(results["memcpy"])
    rows = [
        "| prompt | KV loaded | L1 load | GB/s (memcpy) | L2 load | GB/s (raw LMDB) | "
        "L2 load after a restart | floor | warm (in step) | warm (async) | warm from L2 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, got in results["lengths"].items():
        runs = got["runs"]
        sync = runs["auto"]
        tokens, _, _ = load_of(sync.warm[0])
        nbytes = tokens * p.kv_bytes_per_token
        l1 = statistics.median(s for _, s, _ in map(load_of, sync.warm))
        l2 = statistics.median(s for _, s, _ in map(load_of, sync.evicted))
        restart = statistics.median(s for _, s, _ in map(load_of, sync.l2))
        rows.append(
            f"| {n:,} | {nbytes / (1 << 20):.0f} MiB | {l1 * 1e3:.1f} ms | "
            f"{nbytes / l1 / 1e9:.1f} ({memcpy:.1f}) | {l2 * 1e3:.1f} ms | "
            f"{nbytes / l2 / 1e9:.1f} ({results['lmdb'][n]:.1f}) | {restart * 1e3:.1f} ms | "
            f"{Runs.median(sync.floor) * 1e3:.0f} ms | {Runs.median(sync.warm) * 1e3:.0f} ms | "
            f"{Runs.median(runs['async'].warm) * 1e3:.0f} ms | "
            f"{Runs.median(sync.evicted) * 1e3:.0f} ms |"
        )
    return "\n".join(rows) + "\n"


def run(quick: bool, progress: Progress, work: Path) -> list[Record]:
    import sys

    p = QUICK if quick else FULL
    results = measure(p, progress, work)
    if os.environ.get("KVSTORE_BENCH_LOADS_JSON"):  # the decodes' step times, for a closer look
        Path(os.environ["KVSTORE_BENCH_LOADS_JSON"]).write_text(json.dumps(results["itl"]))
    print(f"[connector] loads, {p.describe()}\n" + table(p, results), file=sys.stderr)
    return records(p, results) + itl_records(p, results)
